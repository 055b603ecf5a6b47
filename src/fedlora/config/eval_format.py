"""``evaluation.format``: its values, spelled once, and the one type that carries it.

The config (``[evaluation] format``), ``fedlora eval --format`` and the library's
`evaluate` / `build_federated_data` all parse the name with `EvalFormat`, so the allowed
values and the message for a bad one come from here alone. ``auto`` is resolved once per
run (`fedlora.llm.harness.resolve_eval_format`, which needs the model's size) and the
concrete value lives in the run's config (``cfg.evaluation.format``).
"""

from __future__ import annotations

from fedlora.errors import bad_value


class EvalFormat(str):
    """The evaluation (and training) format: ``harness`` (lm-eval's requests),
    ``llm-adapters`` (the paper's prompt) or ``auto`` (harness below 3B parameters, resolved
    once the model is loaded). A `str`, so the config, TOML and the run's files keep the
    name; `.harness` is the one test every consumer makes."""

    AUTO = "auto"
    HARNESS = "harness"
    LLM_ADAPTERS = "llm-adapters"
    CONCRETE = (HARNESS, LLM_ADAPTERS)  # what scores and trains: `auto` resolved
    NAMES = (AUTO, *CONCRETE)  # every value evaluation.format accepts

    def __new__(cls, name: str, field: str = "evaluation.format") -> EvalFormat:
        if isinstance(name, EvalFormat):
            return name
        if name not in cls.NAMES:
            raise bad_value(field, name, f"allowed: {', '.join(cls.NAMES)}")
        return super().__new__(cls, name)

    @property
    def auto(self) -> bool:
        """Whether the format is still to be resolved from the model's size."""
        return str(self) == self.AUTO

    @property
    def harness(self) -> bool:
        """Whether questions are lm-eval's requests (else the LLM-Adapters prompt)."""
        return str(self) == self.HARNESS

    def concrete(self) -> EvalFormat:
        """This format, which must be resolved (not ``auto``): what scoring and training
        read."""
        if self.auto:
            raise bad_value(
                "evaluation.format",
                str(self),
                f"allowed: {', '.join(self.CONCRETE)} (resolve auto with the model's size: "
                "fedlora.llm.harness.resolve_eval_format)",
            )
        return self
