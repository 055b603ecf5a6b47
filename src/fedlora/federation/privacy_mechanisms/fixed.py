"""Fixed clipping (``privacy.clipping = "fixed"``): C = ``privacy.clip_norm`` every round,
nothing released beside the update (the base `ClippingRule`)."""

from __future__ import annotations

from fedlora.federation.privacy_mechanisms.base import ClippingRule
from fedlora.federation.privacy_mechanisms.registry import register_clipping


@register_clipping("fixed")
class FixedClipping(ClippingRule):
    """C = privacy.clip_norm."""
