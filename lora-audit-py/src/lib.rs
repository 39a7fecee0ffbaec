//! `lora_audit._native`: the `lora-audit` crate's audit and probe for Python.
//!
//! The Python package (`python/lora_audit/__init__.py`) is the public face:
//! it turns paths and dicts into the strings this module takes and re-exports
//! its classes and exceptions. Everything an answer says comes from the Rust
//! audit unchanged: a report here is the CLI's `--json` report.
//!
//! Must never: panic into Python (every error is an exception of this
//! module), read the environment beyond what the CLI reads
//! (`LoraOptions::from_env`), or keep state between calls.

use std::path::Path;

use lora_audit::{
    AuditArgs, AuditReport, LoraOptions, Refusal, TensorDtype, TensorInfo, audit_adapter, audit_header,
    prepare_adapter, probe_files,
};
use lora_layout::ModelConfig;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyList;

create_exception!(
    lora_audit,
    AuditError,
    PyException,
    "Base of every error the audit raises."
);
create_exception!(
    lora_audit,
    InputError,
    AuditError,
    "Unreadable or invalid input: a missing file, bad JSON, a bad option (the CLI's exit 2)."
);
create_exception!(
    lora_audit,
    RefusedError,
    AuditError,
    "The adapter is not servable (the CLI's exit 1): `codes` holds the refusal codes, `refusals` the \
     refusals, `report` the report where the audit got that far (else None)."
);

/// One refusal or skip: a stable code, the tensor or config field at fault, and why.
#[pyclass(frozen, module = "lora_audit", name = "Refusal")]
#[derive(Clone)]
struct PyRefusal {
    /// The stable code, e.g. `REJECT[rank-too-large]`.
    #[pyo3(get)]
    code: String,
    /// The tensor key or config field at fault.
    #[pyo3(get)]
    tensor: String,
    /// A sentence saying why.
    #[pyo3(get)]
    reason: String,
}

#[pymethods]
impl PyRefusal {
    fn __repr__(&self) -> String {
        format!("Refusal({} {}: {})", self.code, self.tensor, self.reason)
    }
}

impl From<&Refusal> for PyRefusal {
    fn from(r: &Refusal) -> PyRefusal {
        PyRefusal {
            code: r.code.as_str().to_string(),
            tensor: r.subject.clone(),
            reason: r.reason.clone(),
        }
    }
}

/// An adapter's audit: what `lora-audit check --json` prints.
#[pyclass(frozen, module = "lora_audit", name = "Report")]
struct PyReport {
    /// Whether every tensor was placed or skipped as allowed (no refusal).
    #[pyo3(get)]
    servable: bool,
    /// The adapter's name (its directory, or the name given).
    #[pyo3(get)]
    adapter: String,
    refusals: Vec<PyRefusal>,
    skipped: Vec<PyRefusal>,
    /// The report as the CLI's `--json` text.
    #[pyo3(get)]
    json: String,
    /// The report as the CLI's text table.
    #[pyo3(get)]
    text: String,
}

#[pymethods]
impl PyReport {
    /// Every refusal (empty when servable).
    #[getter]
    fn refusals(&self) -> Vec<PyRefusal> {
        self.refusals.clone()
    }

    /// Targets skipped under `allow_partial`, each with its reason.
    #[getter]
    fn skipped(&self) -> Vec<PyRefusal> {
        self.skipped.clone()
    }

    /// The distinct refusal codes, sorted.
    #[getter]
    fn codes(&self) -> Vec<String> {
        codes_of(&self.refusals)
    }

    /// The report as a dict (the CLI's `--json` object).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("json")?.call_method1("loads", (self.json.as_str(),))
    }

    fn __repr__(&self) -> String {
        if self.servable {
            format!("Report({}: servable)", self.adapter)
        } else {
            format!(
                "Report({}: refused {})",
                self.adapter,
                codes_of(&self.refusals).join(", ")
            )
        }
    }
}

impl PyReport {
    fn new(report: &AuditReport, cfg: &ModelConfig) -> PyReport {
        PyReport {
            servable: report.is_servable(),
            adapter: report.adapter.clone(),
            refusals: report.refused.iter().map(PyRefusal::from).collect(),
            skipped: report.skipped.iter().map(PyRefusal::from).collect(),
            json: format!("{:#}", report.to_json(cfg)),
            text: report.to_text(cfg),
        }
    }
}

fn codes_of(refusals: &[PyRefusal]) -> Vec<String> {
    let mut codes: Vec<String> = refusals.iter().map(|r| r.code.clone()).collect();
    codes.sort();
    codes.dedup();
    codes
}

/// A refusal as [`RefusedError`], carrying its codes, refusals and report.
fn refused(py: Python<'_>, refusals: &[Refusal], report: Option<PyReport>) -> PyErr {
    let list: Vec<PyRefusal> = refusals.iter().map(PyRefusal::from).collect();
    let codes = codes_of(&list);
    let err = RefusedError::new_err(format!("adapter refused: {}", codes.join(", ")));
    let value = err.value(py);
    let attach = || -> PyResult<()> {
        value.setattr("codes", codes)?;
        value.setattr("refusals", PyList::new(py, list)?)?;
        match report {
            Some(r) => value.setattr("report", Bound::new(py, r)?),
            None => value.setattr("report", py.None()),
        }
    };
    match attach() {
        Ok(()) => err,
        Err(e) => e,
    }
}

/// An audit error as the Python exception of its kind.
fn audit_err(py: Python<'_>, e: lora_audit::AuditError, cfg: Option<&ModelConfig>) -> PyErr {
    match e {
        lora_audit::AuditError::Refused(report) => {
            let refusals = report.refused.clone();
            refused(py, &refusals, cfg.map(|c| PyReport::new(&report, c)))
        }
        lora_audit::AuditError::ConfigRefused(refusals) => refused(py, &refusals, None),
        other => InputError::new_err(other.to_string()),
    }
}

fn input_err(e: impl std::fmt::Display) -> PyErr {
    InputError::new_err(e.to_string())
}

/// The base model: a `config.json` path or its JSON text.
fn model_config(model_path: Option<&str>, model_json: Option<&str>) -> PyResult<ModelConfig> {
    match (model_path, model_json) {
        (Some(path), None) => ModelConfig::from_file(Path::new(path)).map_err(input_err),
        (None, Some(text)) => ModelConfig::from_hf_config(text).map_err(input_err),
        _ => Err(InputError::new_err(
            "give the model as a config.json path or a dict, not both",
        )),
    }
}

/// The opt-in switches (`--dora`, `--embedding-lora`, `--lm-head-lora`);
/// `false` leaves what `LORA_*` set.
struct OptIn {
    dora: bool,
    embedding_lora: bool,
    lm_head_lora: bool,
}

/// The CLI's options: the `LORA_*` environment, then the arguments.
fn options(
    max_rank: Option<usize>,
    expert_rank: Option<usize>,
    allow_partial: bool,
    experts: bool,
    places: OptIn,
) -> PyResult<LoraOptions> {
    let args = AuditArgs {
        max_rank,
        expert_rank,
        allow_partial,
        experts,
        dora: places.dora,
        embedding_lora: places.embedding_lora,
        lm_head_lora: places.lm_head_lora,
        ..AuditArgs::default()
    };
    LoraOptions::from_env()
        .and_then(|o| o.with_args(args))
        .map_err(input_err)
}

/// Tensors given as `(name, dtype, shape)`.
fn tensor_infos(tensors: Vec<(String, String, Vec<usize>)>) -> PyResult<Vec<TensorInfo>> {
    tensors
        .into_iter()
        .map(|(name, dtype, shape)| {
            let dtype = TensorDtype::from_name(&dtype).ok_or_else(|| {
                InputError::new_err(format!(
                    "tensor `{name}`: dtype `{dtype}` is neither a safetensors nor a torch dtype name"
                ))
            })?;
            Ok(TensorInfo { name, dtype, shape })
        })
        .collect()
}

/// Audit an adapter directory, or an adapter config's JSON text with its
/// tensors' `(name, dtype, shape)`, against a base model.
#[pyfunction]
#[pyo3(signature = (*, adapter_dir=None, config_json=None, tensors=None, name=None, model_path=None,
                    model_json=None, max_rank=None, expert_rank=None, allow_partial=false, experts=false,
                    dora=false, embedding_lora=false, lm_head_lora=false))]
#[allow(clippy::too_many_arguments)]
fn check(
    py: Python<'_>,
    adapter_dir: Option<String>,
    config_json: Option<String>,
    tensors: Option<Vec<(String, String, Vec<usize>)>>,
    name: Option<String>,
    model_path: Option<String>,
    model_json: Option<String>,
    max_rank: Option<usize>,
    expert_rank: Option<usize>,
    allow_partial: bool,
    experts: bool,
    dora: bool,
    embedding_lora: bool,
    lm_head_lora: bool,
) -> PyResult<PyReport> {
    let cfg = model_config(model_path.as_deref(), model_json.as_deref())?;
    let places = OptIn {
        dora,
        embedding_lora,
        lm_head_lora,
    };
    let opts = options(max_rank, expert_rank, allow_partial, experts, places)?;
    let result = match (adapter_dir, config_json, tensors) {
        (Some(dir), None, None) => py.detach(|| audit_adapter(Path::new(&dir), &cfg, &opts)),
        (None, Some(text), Some(tensors)) => {
            let infos = tensor_infos(tensors)?;
            let name = name.unwrap_or_else(|| "adapter".to_string());
            py.detach(|| audit_header(&name, &text, infos, &cfg, &opts))
        }
        (None, Some(_), None) => {
            return Err(InputError::new_err(
                "an adapter config needs its tensors: tensors={name: (dtype, shape)}",
            ));
        }
        _ => {
            return Err(InputError::new_err(
                "give the adapter as a directory or as a config dict",
            ));
        }
    };
    match result {
        Ok(report) => Ok(PyReport::new(&report, &cfg)),
        Err(e) => Err(audit_err(py, e, Some(&cfg))),
    }
}

/// An adapter's served deltas for probe inputs (the CLI's `probe`): writes
/// `out` and returns `(written tensor names, unserved weights)`.
#[pyfunction]
#[pyo3(signature = (*, adapter_dir, model_path=None, model_json=None, probes, out, base=None,
                    max_rank=None, expert_rank=None, allow_partial=false, experts=false, dora=false,
                    embedding_lora=false, lm_head_lora=false))]
#[allow(clippy::too_many_arguments)]
fn probe(
    py: Python<'_>,
    adapter_dir: String,
    model_path: Option<String>,
    model_json: Option<String>,
    probes: String,
    out: String,
    base: Option<String>,
    max_rank: Option<usize>,
    expert_rank: Option<usize>,
    allow_partial: bool,
    experts: bool,
    dora: bool,
    embedding_lora: bool,
    lm_head_lora: bool,
) -> PyResult<(Vec<String>, Vec<String>)> {
    let cfg = model_config(model_path.as_deref(), model_json.as_deref())?;
    let places = OptIn {
        dora,
        embedding_lora,
        lm_head_lora,
    };
    let opts = options(max_rank, expert_rank, allow_partial, experts, places)?;
    let adapter = py
        .detach(|| prepare_adapter(Path::new(&adapter_dir), &cfg, &opts))
        .map_err(|e| audit_err(py, e, Some(&cfg)))?;
    let base = base.as_deref().map(Path::new);
    py.detach(|| probe_files(&adapter, &cfg, Path::new(&probes), base, Path::new(&out)))
        .map(|outputs| (outputs.tensors.keys().cloned().collect(), outputs.unserved))
        .map_err(|e| audit_err(py, e, Some(&cfg)))
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    m.add_class::<PyReport>()?;
    m.add_class::<PyRefusal>()?;
    m.add("AuditError", py.get_type::<AuditError>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("RefusedError", py.get_type::<RefusedError>())?;
    Ok(())
}
