"""Types of the Rust extension module (see lora_audit/__init__.py for the API)."""

from typing import Any, Optional, Sequence, Tuple

class AuditError(Exception):
    """Base of every error the audit raises."""

class InputError(AuditError):
    """Unreadable or invalid input (the command's exit 2)."""

class RefusedError(AuditError):
    """The adapter is not servable (the command's exit 1)."""
    codes: list[str]
    refusals: list["Refusal"]
    report: Optional["Report"]

class Refusal:
    """One refusal or skip."""
    @property
    def code(self) -> str: ...
    @property
    def tensor(self) -> str: ...
    @property
    def reason(self) -> str: ...

class Report:
    """An adapter's audit: what `lora-audit check --json` prints."""
    @property
    def servable(self) -> bool: ...
    @property
    def adapter(self) -> str: ...
    @property
    def refusals(self) -> list[Refusal]: ...
    @property
    def skipped(self) -> list[Refusal]: ...
    @property
    def codes(self) -> list[str]: ...
    @property
    def json(self) -> str: ...
    @property
    def text(self) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...

def check(
    *,
    adapter_dir: Optional[str] = None,
    config_json: Optional[str] = None,
    tensors: Optional[Sequence[Tuple[str, str, Sequence[int]]]] = None,
    name: Optional[str] = None,
    model_path: Optional[str] = None,
    model_json: Optional[str] = None,
    max_rank: Optional[int] = None,
    expert_rank: Optional[int] = None,
    allow_partial: bool = False,
    experts: bool = False,
    dora: bool = False,
    embedding_lora: bool = False,
    lm_head_lora: bool = False,
) -> Report: ...

def probe(
    *,
    adapter_dir: str,
    model_path: Optional[str] = None,
    model_json: Optional[str] = None,
    probes: str,
    out: str,
    base: Optional[str] = None,
    max_rank: Optional[int] = None,
    expert_rank: Optional[int] = None,
    allow_partial: bool = False,
    experts: bool = False,
    dora: bool = False,
    embedding_lora: bool = False,
    lm_head_lora: bool = False,
) -> Tuple[list[str], list[str]]: ...
