"""What pyproject.toml declares against what the code imports.

CI installs one version of each package, so the suite cannot run against every floor. What is checked here:

* the huggingface_hub floor: every name and keyword ``convert/hub.py`` takes from it is listed in
  :data:`HUB_USES` with the earliest release checked to have it, and the declared floor is the newest of
  those. The releases were read from the published wheels (``pip download huggingface_hub==V --no-deps``);
  ``tests/test_hub.py`` passes with 1.1.0 installed and fails with 1.0.0 (``hf_hub_download`` has no
  ``tqdm_class`` there). To repeat it: ``python3 -m venv --system-site-packages /tmp/v && /tmp/v/bin/pip
  install huggingface_hub==1.1.0 && /tmp/v/bin/python -m pytest -q tests/test_hub.py``;
* the safetensors floor: 0.6.1 is the first release that reads and writes F8_E8M0, the dtype of DeepSeek-V4's
  block scales (0.5.3's ``save_file`` raises ``KeyError: torch.float8_e8m0fnu``);
* every package the code imports is declared, every declared one is used, the CUDA-only packages are in the
  ``gpu`` extra and nowhere else in the base install;
* with the ``gpu`` extra's packages made unimportable, the converter, verify, inspect and the CPU runtime run.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import warnings
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from hostile_inputs import pristine

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FILES = sorted([*ROOT.glob("*.py"), *(p for d in ("convert", "runtime", "kernels") for p in (ROOT / d).glob("*.py"))])
# the files that run only on a GPU (compiling or launching the CuTeDSL kernels)
GPU_PATH = {"kernels/cute_host.py", "kernels/compile_workers.py", "runtime/hopper.py"} | {f"kernels/{p.name}" for p in (ROOT / "kernels").glob("sm90_*.py")}

# What convert/hub.py takes from huggingface_hub -> the earliest release checked to have it (module docstring).
HUB_USES = {
    "huggingface_hub.HfApi": "0.30.0",
    "huggingface_hub.hf_hub_download": "0.30.0",
    "huggingface_hub.constants": "0.30.0",
    "huggingface_hub.constants.ENDPOINT": "0.30.0",
    "huggingface_hub.constants.HF_HUB_OFFLINE": "0.30.0",
    "huggingface_hub.errors.GatedRepoError": "0.30.0",
    "huggingface_hub.errors.LocalEntryNotFoundError": "0.30.0",
    "huggingface_hub.errors.OfflineModeIsEnabled": "0.30.0",
    "huggingface_hub.errors.RepositoryNotFoundError": "0.30.0",
    "huggingface_hub.errors.RevisionNotFoundError": "0.30.0",
    "huggingface_hub.errors.SafetensorsParsingError": "0.30.0",
    "huggingface_hub.errors.RemoteEntryNotFoundError": "1.0.0",
    "hf_hub_download(revision=)": "0.30.0",
    "hf_hub_download(cache_dir=)": "0.30.0",
    "hf_hub_download(local_dir=)": "0.30.0",
    "hf_hub_download(local_files_only=)": "0.30.0",
    "hf_hub_download(tqdm_class=)": "1.1.0",
    "HfApi.model_info(revision=)": "0.30.0",
    "HfApi.model_info(files_metadata=)": "0.30.0",
    "HfApi.parse_safetensors_file_metadata(revision=)": "0.30.0",
}
SAFETENSORS_FLOOR = "0.6.1"  # F8_E8M0
# Declared, but never imported by name: why each is needed.
USED_WITHOUT_IMPORT = {"numpy": "torch's Tensor.numpy() (convert/source.py, convert/writer.py); the CPU torch wheel "
                                "does not require numpy"}
# Modules a distribution installs on sys.path by its own means (importlib.metadata cannot map them).
MODULE_DISTRIBUTION = {"cutlass": "nvidia-cutlass-dsl"}
GPU_DISTRIBUTIONS = {"nvidia-cutlass-dsl", "apache-tvm-ffi"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name((r := Requirement(s)).name): r for s in specs}


def _floor(req: Requirement) -> Version:
    (spec,) = [s for s in req.specifier if s.operator == ">="]
    return Version(spec.version)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _hub_uses(tree: ast.Module) -> set[str]:
    """Names imported from huggingface_hub, ``constants.X`` read, keywords of the Hub calls (see :data:`HUB_USES`)."""
    uses, constants = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("huggingface_hub"):
            for alias in node.names:
                uses.add(f"{node.module}.{alias.name}")
                constants |= alias.name == "constants"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "constants":
            uses.add(f"huggingface_hub.constants.{node.attr}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "hf_hub_download":
                uses |= {f"hf_hub_download({k.arg}=)" for k in node.keywords}
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "api":
                uses |= {f"HfApi.{f.attr}({k.arg}=)" for k in node.keywords}
    return uses


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports (at any depth of the file), other projects' only."""
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("__future__", "nvfp4_megamoe")}


def _distribution(module: str) -> str:
    if module in MODULE_DISTRIBUTION:
        return MODULE_DISTRIBUTION[module]
    found = importlib.metadata.packages_distributions().get(module)
    assert found, f"no installed distribution provides the module {module!r}"
    return canonicalize_name(found[0])


def test_the_huggingface_hub_floor_is_the_newest_release_the_code_needs():
    uses = set().union(*(_hub_uses(_tree(p)) for p in PACKAGE_FILES if "huggingface_hub" in p.read_text()))
    assert uses, "convert/hub.py reads the Hub through huggingface_hub"
    unrecorded = uses - HUB_USES.keys()
    assert not unrecorded, f"record in HUB_USES the first huggingface_hub release that has {sorted(unrecorded)}"
    floor = _floor(_requirements(_project()["dependencies"])["huggingface-hub"])
    assert floor == max(Version(v) for v in HUB_USES.values()), floor
    import huggingface_hub

    assert Version(huggingface_hub.__version__) >= floor
    for use in HUB_USES:  # every recorded name is real in the installed release (no typo hides a use)
        if "(" in use:
            owner, kw = use[:-2].split("(")
            fn = getattr(huggingface_hub.HfApi, owner.split(".")[1]) if owner.startswith("HfApi.") else \
                getattr(huggingface_hub, owner)
            assert kw in inspect.signature(fn).parameters, use
        else:
            module, _, name = use.rpartition(".")
            assert hasattr(importlib.import_module(module), name), use


def test_the_safetensors_floor_reads_and_writes_e8m0(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    assert _floor(_requirements(_project()["dependencies"])["safetensors"]) == Version(SAFETENSORS_FLOOR)
    t = torch.arange(8, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file({"s": t}, tmp_path / "e8m0.safetensors")  # as synth writes and the runtime reads
    with safe_open(tmp_path / "e8m0.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("s").view(torch.uint8), t.view(torch.uint8))


def test_imports_and_declared_dependencies_agree():
    project = _project()
    base = _requirements(project["dependencies"])
    extras = {k: _requirements(v) for k, v in project["optional-dependencies"].items()}
    imported: dict[str, set[str]] = {}
    for path in PACKAGE_FILES:
        for module in _imported_modules(path):
            imported.setdefault(_distribution(module), set()).add(path.relative_to(ROOT).as_posix())
    for dist, files in imported.items():
        if dist in GPU_DISTRIBUTIONS:
            assert dist in extras["gpu"] and files <= GPU_PATH, (dist, files - GPU_PATH)
        else:
            assert dist in base, f"{dist} is imported by {sorted(files)} but not declared"
    assert not GPU_DISTRIBUTIONS & base.keys(), "a CUDA-only package in the base install"
    assert GPU_DISTRIBUTIONS <= extras["gpu"].keys()
    assert not set(base) - set(imported) - USED_WITHOUT_IMPORT.keys(), "declared but never used"
    # the CPU test suite compiles the kernels: [test] pulls [gpu]
    assert any(r.name == project["name"] and "gpu" in r.extras for r in extras["test"].values())
    plots = {m for p in (ROOT / "bench").glob("*.py") for m in _imported_modules(p)} & {"matplotlib"}
    assert plots and "matplotlib" in extras["bench"]


_WITHOUT_GPU_PACKAGES = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
BEFORE = set(sys.modules)  # a .pth file may import a blocked package at start-up: only what the code loads counts

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
import torch
from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.inspect import inspect_checkpoint
from nvfp4_megamoe.convert.verify import verify_checkpoint
from nvfp4_megamoe.runtime import load_model

src, out = sys.argv[2], sys.argv[3]
convert_checkpoint(src, out, progress=False)
assert verify_checkpoint(out, progress=False).ok
assert inspect_checkpoint(out)["tensors"] > 0
logits = load_model(out, device="cpu")(torch.tensor([[1, 2, 3]]))
assert logits.shape[:2] == (1, 3) and bool(torch.isfinite(logits).all())
print("ran without", sorted(BLOCKED), "loaded:", sorted(m for m in set(sys.modules) - BEFORE if m.split(".")[0] in BLOCKED))
"""


def test_the_base_install_converts_verifies_inspects_and_runs_without_the_gpu_packages(tmp_path_factory, tmp_path):
    blocked = {m for m, dists in importlib.metadata.packages_distributions().items()
               if any(canonicalize_name(d).startswith(tuple(GPU_DISTRIBUTIONS)) for d in dists)}
    blocked |= set(MODULE_DISTRIBUTION)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_GPU_PACKAGES, ",".join(sorted(blocked)),
                           str(pristine(tmp_path_factory, "flash")), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cutlass" in done.stdout and "loaded: []" in done.stdout, done.stdout


def test_load_model_says_what_to_install_on_a_hopper_gpu_without_cutedsl(monkeypatch):
    import torch

    from nvfp4_megamoe.runtime import model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    with pytest.warns(UserWarning, match=r"nvfp4-megamoe\[gpu\]"):
        model._warn_without_kernels("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model._warn_without_kernels("cuda")  # another GPU: no Hopper kernels to miss
