"""The Python package answers as the `lora-audit` command does.

Run against an installed wheel, with `LORA_AUDIT_BIN` naming the command
(`target/debug/lora-audit`, built by `cargo build -p lora-audit-cli`).
"""

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

import lora_audit

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
CLI = os.environ.get("LORA_AUDIT_BIN", str(ROOT / "target" / "debug" / "lora-audit"))
# The CLI and the package read the same LORA_* options; none may leak in.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("LORA_")}


@pytest.fixture(autouse=True)
def no_lora_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("LORA_"):
            monkeypatch.delenv(key)


def adapters():
    """Every bundled fixture adapter: (model dir, adapter dir)."""
    out = []
    for config in sorted(FIXTURES.glob("*/config.json")):
        for adapter in sorted(config.parent.iterdir()):
            if (adapter / "adapter_config.json").is_file():
                out.append(pytest.param(config.parent, adapter, id=f"{config.parent.name}/{adapter.name}"))
    return out


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=CLEAN_ENV, timeout=120)


def header_tensors(path):
    """A safetensors file's tensors as {name: (dtype, shape)}, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


def test_the_command_is_there():
    assert Path(CLI).is_file(), f"build it first: cargo build -p lora-audit-cli ({CLI})"


@pytest.mark.parametrize("model,adapter", adapters())
@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
@pytest.mark.parametrize("opt_in", [False, True], ids=["plain", "opt-in"])
def test_check_gives_the_commands_report(model, adapter, experts, opt_in):
    """Also with every opt-in place (DoRA, the embedding's and the head's)
    switched on, by keyword here and by flag there."""
    flags = ["--max-rank", "16", "--json"] + (["--experts"] if experts else [])
    if opt_in:
        flags += ["--dora", "--embedding-lora", "--lm-head-lora"]
    keywords = dict(max_rank=16, experts=experts, dora=opt_in, embedding_lora=opt_in, lm_head_lora=opt_in)
    done = cli("check", adapter, "--model", model / "config.json", *flags)
    if done.returncode == 2:
        # Unreadable or unservable by its config alone: an exception, never a report.
        with pytest.raises(lora_audit.AuditError):
            lora_audit.check(adapter, model / "config.json", **keywords)
        return
    assert done.returncode in (0, 1), done.stderr
    report = lora_audit.check(adapter, model / "config.json", **keywords)
    assert report.to_dict() == json.loads(done.stdout)
    assert report.servable == (done.returncode == 0)
    assert report.servable == (not report.refusals)
    assert report.codes == sorted({r["code"] for r in json.loads(done.stdout)["refused"]})
    for r in report.refusals:
        assert r.code.startswith("REJECT[") and r.reason


@pytest.mark.parametrize("model,adapter", adapters())
def test_a_config_dict_with_its_tensors_is_audited_as_the_directory(model, adapter):
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        pytest.skip("no safetensors weights (a pickle fixture)")
    config = json.loads((adapter / "adapter_config.json").read_text())
    model_config = json.loads((model / "config.json").read_text())
    try:
        from_dir = lora_audit.check(adapter, model / "config.json", experts=True)
    except lora_audit.AuditError as e:
        with pytest.raises(type(e)):
            lora_audit.check(config, model_config, tensors=header_tensors(weights), experts=True)
        return
    from_dict = lora_audit.check(config, model_config, tensors=header_tensors(weights), experts=True,
                                 name=from_dir.adapter)
    want, got = from_dir.to_dict(), from_dict.to_dict()
    # The dict form reads no values: a non-finite refusal is the directory's alone.
    want["refused"] = [r for r in want["refused"] if r["code"] != "REJECT[non-finite]"]
    want["servable"] = not want["refused"]
    assert got == want


def test_a_refused_adapter_is_a_report_from_check_and_an_exception_from_probe(tmp_path):
    model, adapter = FIXTURES / "llama", FIXTURES / "llama" / "dora"
    report = lora_audit.check(adapter, model / "config.json")
    assert not report.servable and report.codes
    assert "refused" in repr(report)
    with pytest.raises(lora_audit.RefusedError) as caught:
        lora_audit.probe(adapter, model / "config.json", adapter / "oracle.safetensors", tmp_path / "out.safetensors")
    err = caught.value
    assert err.codes == report.codes
    assert [r.code for r in err.refusals] == [r.code for r in report.refusals]
    assert err.report is not None and err.report.to_dict() == report.to_dict()
    assert isinstance(err, lora_audit.AuditError)
    assert not (tmp_path / "out.safetensors").exists()


def test_probe_writes_what_the_command_writes(tmp_path):
    model, adapter = FIXTURES / "llama", FIXTURES / "llama" / "trainable_tokens_untied_dict"
    probes, tables = adapter / "oracle.safetensors", model / "tables.safetensors"
    ours = lora_audit.probe(adapter, model / "config.json", probes, tmp_path / "py.safetensors", base=tables)
    done = cli("probe", adapter, "--model", model / "config.json", "--probes", probes, "--base", tables,
               "--out", tmp_path / "cli.safetensors", "--json")
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)
    assert sorted(ours["written"]) == sorted(theirs["written"]) and ours["written"]
    assert ours["unserved"] == theirs["unserved"]
    assert (tmp_path / "py.safetensors").read_bytes() == (tmp_path / "cli.safetensors").read_bytes()


@pytest.mark.parametrize(
    "call",
    [
        lambda: lora_audit.check(FIXTURES / "llama" / "no_such_adapter", FIXTURES / "llama" / "config.json"),
        lambda: lora_audit.check(FIXTURES / "llama" / "rslora", FIXTURES / "no_such_model.json"),
        lambda: lora_audit.check(FIXTURES / "llama" / "rslora", {"model_type": "llama"}),
        lambda: lora_audit.check(FIXTURES / "llama" / "rslora", FIXTURES / "llama" / "config.json", max_rank=0),
        lambda: lora_audit.check({"peft_type": "LORA", "r": 8}, FIXTURES / "llama" / "config.json"),
        lambda: lora_audit.check({"peft_type": "LORA", "r": 8}, FIXTURES / "llama" / "config.json",
                                 tensors={"x": ("complex64", [1])}),
        lambda: lora_audit.check({"peft_type": "LORA", "r": 8}, FIXTURES / "llama" / "config.json",
                                 tensors={"x": ("BF16", [-1])}),
        lambda: lora_audit.check({"peft_type": "LORA", "r": 8}, FIXTURES / "llama" / "config.json",
                                 tensors={"x": ("BF16", [2**70])}),
        lambda: lora_audit.check(12, FIXTURES / "llama" / "config.json"),
        lambda: lora_audit.check(FIXTURES / "llama" / "rslora", 3.5),
    ],
    ids=["missing-adapter", "missing-model", "incomplete-model", "rank-0", "dict-without-tensors",
         "unknown-dtype", "negative-dim", "huge-dim", "adapter-type", "model-type"],
)
def test_bad_input_raises_input_error(call):
    with pytest.raises(lora_audit.InputError) as caught:
        call()
    assert isinstance(caught.value, lora_audit.AuditError)
    assert str(caught.value)


def test_a_hostile_config_dict_is_refused_not_crashed():
    model = FIXTURES / "llama" / "config.json"
    bad = {"peft_type": "LORA", "r": 8, "lora_alpha": 1e40, "target_modules": ["q_proj"],
           "alpha_pattern": {"(?i)Q_PROJ": 1000}}
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{name}.lora_A.weight": ("BF16", [8, 64]), f"{name}.lora_B.weight": ("BF16", [64, 8])}
    try:
        report = lora_audit.check(bad, model, tensors=tensors)
    except lora_audit.RefusedError as e:
        assert e.codes
    else:
        assert not report.servable and report.codes


def test_a_training_scripts_objects_are_accepted():
    """Sets, enums and torch-like dtypes, as LoraConfig.to_dict() and a model
    config's to_dict() hold them, and tensors given as objects with a dtype
    and a shape (a state dict's values)."""
    import enum

    class TaskType(enum.Enum):
        CAUSAL_LM = "CAUSAL_LM"

    class Dtype:
        def __str__(self):
            return "torch.bfloat16"

    class Tensor:
        def __init__(self, shape):
            self.dtype, self.shape = Dtype(), tuple(shape)

    adapter = FIXTURES / "llama" / "rslora"
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = set(config["target_modules"])
    config["task_type"] = TaskType.CAUSAL_LM
    model = json.loads((FIXTURES / "llama" / "config.json").read_text())
    model["torch_dtype"] = Dtype()
    tensors = {k: Tensor(shape) for k, (_, shape) in header_tensors(adapter / "adapter_model.safetensors").items()}
    report = lora_audit.check(config, model, tensors=tensors, name="rslora")
    want = lora_audit.check(adapter, FIXTURES / "llama" / "config.json").to_dict()
    got = report.to_dict()
    # The dtypes differ (the fixture's own against bfloat16): compare the placement.
    assert got["placed"] == want["placed"] and got["servable"] == want["servable"]


def test_the_type_stubs_name_what_the_module_holds():
    import ast
    import importlib.resources

    stub = importlib.resources.files("lora_audit").joinpath("_native.pyi").read_text()
    named = {n.name for n in ast.parse(stub).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    public = {n for n in dir(lora_audit._native) if not n.startswith("_")}
    assert named == public
    assert importlib.resources.files("lora_audit").joinpath("py.typed").is_file()
    for cls in (lora_audit.Report, lora_audit.Refusal):
        node = next(n for n in ast.parse(stub).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        members = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
        assert members == {m for m in dir(cls) if not m.startswith("_")}, cls.__name__
