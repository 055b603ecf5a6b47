"""Client-level differential privacy mechanisms (``privacy.mode``) and clipping rules
(``privacy.clipping``): one short file each, the same verbs (`base.PrivacyMechanism`,
`base.ClippingRule`), registered by name (`registry`; third-party ones from the
``fedlora.privacy`` and ``fedlora.privacy_clipping`` entry-point groups).

Every module of this folder is imported here, so each registers itself.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # a mechanism is one file: its decorator runs
    importlib.import_module(f"{__name__}.{_module.name}")
