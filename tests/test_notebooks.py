"""Every notebook in notebooks/ runs top to bottom without a cell error, in this venv's Python."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DEVICE_FLAG = "--xla_force_host_platform_device_count"

# Appended to each notebook (in memory): which interpreter and which ucp_jax the kernel really ran.
_PROBE = """
import json as _json, sys as _sys
import jax as _jax, ucp_jax as _ucp_jax
print("UCP-PROBE " + _json.dumps({"prefix": _sys.prefix, "executable": _sys.executable,
      "ucp_jax": _ucp_jax.__file__, "devices": _jax.device_count()}))
"""


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, f"no notebooks under {ROOT / 'notebooks'}"


@pytest.fixture
def this_python_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make kernel ``python3`` this interpreter, importing this checkout's ``ucp_jax``.

    A ``python3`` kernelspec elsewhere (a user's ``~/.local/share/jupyter``) could point at another
    Python; a kernelspec first on ``JUPYTER_PATH`` whose argv is ``sys.executable`` wins over it.
    The kernel inherits pytest's environment (``XLA_FLAGS``...), plus this checkout on PYTHONPATH.
    """
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ucp_jax tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    paths = [str(tmp_path / "jupyter"), os.environ.get("JUPYTER_PATH", "")]
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(p for p in paths if p))
    pythonpath = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in pythonpath if p))
    return "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_sets_the_device_count_before_jax(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "code", f"{path.name}: the first cell must be code setting XLA_FLAGS"
    assert "XLA_FLAGS" in first.source and f"{DEVICE_FLAG}=8" in first.source, first.source
    assert "import jax" not in first.source and "from jax" not in first.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_clean_and_small(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{path.name} cell {i} was committed with an error"
    assert path.stat().st_size < 400_000, f"{path.name}: {path.stat().st_size} bytes; trim outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(
    path: Path, this_python_kernel: str, tmp_path: Path, monkeypatch
) -> None:
    # the kernel inherits this: what a notebook writes with `tempfile` lands in the test's own
    # folder, removed when it passes (the notebooks leave their checkpoints for a reader to see)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    if any("torch" in c.source for c in nb.cells if c.cell_type == "code"):
        pytest.importorskip("torch")  # a PyTorch notebook (CI has torch: conftest insists)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name=this_python_kernel,
        resources={"metadata": {"path": str(path.parent)}},
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    seconds = time.perf_counter() - t0
    errors = [
        (i, out.get("ename"), out.get("evalue"))
        for i, cell in enumerate(nb.cells)
        for out in cell.get("outputs", [])
        if out.output_type == "error"
    ]
    assert not errors, errors
    probe_out = "".join(
        o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream"
    )
    line = next(ln for ln in probe_out.splitlines() if ln.startswith("UCP-PROBE "))
    probe = json.loads(line.removeprefix("UCP-PROBE "))
    print(f"\n{path.name}: executed in {seconds:.1f}s by {probe['executable']}")
    assert Path(probe["prefix"]) == Path(sys.prefix), (probe, sys.prefix)
    assert Path(probe["ucp_jax"]).resolve().is_relative_to(ROOT), probe
    assert probe["devices"] == 8, probe
