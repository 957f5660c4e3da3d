"""The package as users get it: ``python -m build`` makes an sdist and a wheel; the wheel, installed into a fresh
virtual environment, runs a 2-rank vocab-sharded example under torchrun from outside the source tree.

The venv sees the system site-packages (``--system-site-packages``), so the torch already installed there is reused
rather than downloaded again, which also shows that an installed torch satisfies ``torch>=2.4``: pip keeps it. The
venv's own site-packages come first on ``sys.path``, so ``import vpce`` finds the wheel's copy, not this checkout
(the example checks ``vpce.__file__``). Every subprocess has a timeout, so a hung rank fails the test.

Building and resolving need a package index (``python -m build`` fetches its build requirements). On a machine
that has none, such as the GPU machines, ``VPCE_OFFLINE=1`` skips the tests that build or resolve (``_needs_index``);
it is never set on CI, where a missing index must fail.
"""

import os
import re
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)

# One uneven split of a padded vocab over 2 gloo ranks, in float64, against the unsharded torch loss and gradients.
EXAMPLE = textwrap.dedent(r'''
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import vpce

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                                  # the same full problem on every rank
    vocab, padded, dim, n = 1000, 1024, 32, 96
    weight = torch.randn(padded, dim, dtype=torch.float64) / dim**0.5
    hidden = torch.randn(n, dim, dtype=torch.float64)
    target = torch.randint(0, vocab, (n,))
    bounds = [padded * r * (r + 1) // (world * (world + 1)) for r in range(world + 1)]  # rank r: ~(r + 1) shares
    rows = slice(bounds[rank], bounds[rank + 1])

    h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    loss = vpce.linear_cross_entropy(h, w, target, group=dist.group.WORLD, vocab_size=vocab)
    loss.backward()

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref[:vocab].T, target)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, msg=lambda m: f"rank {rank}: loss: {m}")
    torch.testing.assert_close(h.grad, h_ref.grad, msg=lambda m: f"rank {rank}: dX: {m}")
    torch.testing.assert_close(w.grad, w_ref.grad[rows], msg=lambda m: f"rank {rank}: dW rows {rows}: {m}")
    sys.stdout.write(f"rank {rank} of {world}: OK, loss {loss.item():.6f}, vpce {vpce.__version__} from "
                     f"{vpce.__file__}\n")  # one write: the ranks share torchrun's stdout
    # every rank done with the group before any rank tears it down: a gloo rank whose peer has already closed its
    # connections can abort in teardown ("terminate called without an active exception", seen once in CI)
    dist.barrier()
    dist.destroy_process_group()
''')


def _run(cmd, *, cwd, env=None, timeout=180) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (f"{' '.join(map(str, cmd))}: exit {out.returncode}\n--- stdout\n{out.stdout[-4000:]}"
                                 f"\n--- stderr\n{out.stderr[-4000:]}")
    return out


def _needs_index():
    if os.environ.get("VPCE_OFFLINE") == "1":
        pytest.skip("VPCE_OFFLINE=1: no package index to build against or resolve from")


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """``python -m build``: the sdist, then the wheel built from the unpacked sdist (so the sdist is complete)."""
    _needs_index()
    outdir = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", outdir, ROOT], cwd=outdir, timeout=300)
    found = {"sdist": sorted(outdir.glob("vpce-*.tar.gz")), "wheel": sorted(outdir.glob("vpce-*.whl"))}
    assert all(len(v) == 1 for v in found.values()), f"expected one sdist and one wheel in {outdir}, got {found}"
    return {kind: paths[0] for kind, paths in found.items()}


def test_sdist_and_wheel_contents(dists):
    assert dists["sdist"].name == f"vpce-{VERSION}.tar.gz" and dists["wheel"].name.startswith(f"vpce-{VERSION}-")
    with tarfile.open(dists["sdist"]) as tar:
        sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = {"LICENSE", "CHANGELOG.md", "README.md", "docs/api.md", "vpce/api.py", "launch/demo.py"} - sdist
    assert not missing, f"sdist lacks {sorted(missing)}"
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"vpce-{VERSION}.dist-info/METADATA").decode()
    assert f"vpce-{VERSION}.dist-info/licenses/LICENSE" in names, sorted(names)
    assert {"vpce/__init__.py", "vpce/integrations/transformers.py", "vpce/bench/__main__.py"} <= names
    assert "License-Expression: Apache-2.0" in meta, meta[:1500]
    assert re.findall(r"(?m)^Requires-Dist: (.*)$", meta)[0] == "torch>=2.4", meta[:1500]


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo over localhost")
def test_wheel_in_fresh_venv_runs_sharded_example(dists, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    # nothing of a checkout on sys.path, for pip too: a vpce.egg-info reached through PYTHONPATH makes pip skip the
    # wheel as "already installed"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    # the running interpreter's pip installs into the venv (no pip of the venv's own, which would bring an older
    # setuptools that shadows the one torch needs); --no-index: the dependency must be satisfied by what is there
    install = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index",
                    "--disable-pip-version-check", dists["wheel"]], cwd=tmp_path, env=env)
    assert re.search(r"Requirement already satisfied: torch>=2\.4", install.stdout), install.stdout

    work = tmp_path / "outside"  # outside the repository: nothing of the checkout on sys.path
    work.mkdir()
    (work / "sharded_example.py").write_text(EXAMPLE)
    version = _run([python, "-c", "import vpce; print(vpce.__version__); print(vpce.__file__)"], cwd=work, env=env)
    got_version, got_file = version.stdout.split()
    assert got_version == VERSION, version.stdout
    assert Path(got_file).is_relative_to(env_dir), f"vpce imported from {got_file}, not from the venv {env_dir}"

    run = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "sharded_example.py"],
               cwd=work, env=env, timeout=120)
    ok = dict(re.findall(r"rank (\d) of 2: OK, loss \S+, vpce \S+ from (\S+?/vpce/__init__\.py)", run.stdout))
    assert sorted(ok) == ["0", "1"], run.stdout
    assert all(Path(f).is_relative_to(env_dir) for f in ok.values()), f"not the venv's vpce: {ok}"


#: vpce's extras and what each must pin (README.md's install table says the same; test_readme_lists_every_extra).
EXTRAS = {
    "test": {"pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3.2", "numpy", "triton>=3.2", "megatron-core==0.16.1",
             "transformers<6,>=4.57", "build", "matplotlib", "accelerate>=1.1", "peft==0.18.1"},
    "bench": {"matplotlib", "numpy"},
    "megatron": {"megatron-core>=0.12"},
    "transformers": {"transformers<6,>=4.57", "accelerate>=1.1"},
    "torchtune": {"torchtune==0.6.1", "torchao<0.16,>=0.13"},
    "trl": {"trl==1.16.0"},
    "hopper": {"quack-kernels==0.6.5", "nvidia-cutlass-dsl==4.7.1"},
}


def _wheel_extras(wheel: Path) -> dict[str, set[str]]:
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(f"vpce-{VERSION}.dist-info/METADATA").decode()
    out: dict[str, set[str]] = {name: set() for name in re.findall(r"(?m)^Provides-Extra: (\S+)$", meta)}
    for req, extra in re.findall(r"""(?m)^Requires-Dist: (.*?); extra == "([^"]+)"$""", meta):
        out[extra].add(req.replace(" ", ""))
    return out


def test_wheel_declares_every_extra_with_its_pins(dists):
    assert _wheel_extras(dists["wheel"]) == {k: {r.replace(" ", "") for r in v} for k, v in EXTRAS.items()}


def test_readme_lists_every_extra():
    """README.md's install section names every extra with its pins, as the wheel declares them."""
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra, reqs in EXTRAS.items():
        row = next((line for line in install.splitlines() if line.startswith(f"| `{extra}` |")), None)
        assert row is not None, f"README.md's install table has no row for the `{extra}` extra"
        for req in reqs:
            name = re.split(r"[<>=!~]", req, maxsplit=1)[0]
            pins = re.findall(r"[<>=!~]=?[^,<>=!~]+", req)
            assert name in row and all(p in row.replace(" ", "") for p in pins), f"{extra}: {req} not in {row}"


def _offline_indexes() -> list[str]:
    """The pip indexes on this machine's disk (``file://`` URLs in ``pip config``): the test stays offline."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    urls = [u for line in out.stdout.splitlines() if "index-url" in line
            for u in line.split("=", 1)[1].strip("'\" ").split() if u.startswith("file://")]
    return [a for i, u in enumerate(urls) for a in (("--index-url" if i == 0 else "--extra-index-url"), u)]


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    _needs_index()
    env_dir = tmp_path_factory.mktemp("extras") / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    return env_dir / "bin" / "python"


@pytest.mark.skipif(sys.platform == "win32", reason="venv layout")
@pytest.mark.parametrize("extra", list(EXTRAS))
def test_every_extra_resolves_from_the_wheel(dists, bare_venv, extra, tmp_path):
    """``pip install "vpce[<extra>] @ file://<wheel>"`` into a fresh venv resolves (``--dry-run``), offline: from
    the wheel, what is installed, and the pip indexes on this machine's disk. A requirement that only PyPI has
    (torchtune's tree pulls kagglesdk) skips that extra, naming it; any other failure fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    indexes = _offline_indexes() or ["--no-index"]
    cmd = [sys.executable, "-m", "pip", "--python", bare_venv, "install", "--dry-run", "--disable-pip-version-check",
           *indexes, "--find-links", dists["wheel"].parent, f"vpce[{extra}] @ {dists['wheel'].as_uri()}"]
    out = subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        absent = re.findall(r"No matching distribution found for (\S+)", out.stderr)
        if absent and "--no-index" not in indexes:
            pytest.skip(f"vpce[{extra}] needs {absent[0]}, which is neither installed nor in this machine's offline "
                        f"indexes (PyPI has it)")
        pytest.fail(f"vpce[{extra}] does not resolve:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    assert re.search(rf"Would install .*vpce-{re.escape(VERSION)}", out.stdout), out.stdout[-2000:]


def test_install_from_a_path_resolves(bare_venv, tmp_path):
    """README's `pip install "vpce[trl] @ file:///path/to/vpce"` (the same as `pip install ".[trl]"` in the clone):
    pip builds the metadata from the source tree and resolves the extra, offline (``--dry-run``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    cmd = [sys.executable, "-m", "pip", "--python", bare_venv, "install", "--dry-run", "--disable-pip-version-check",
           "--no-build-isolation", *(_offline_indexes() or ["--no-index"]), f"vpce[trl] @ {ROOT.as_uri()}"]
    out = _run(cmd, cwd=tmp_path, env=env)
    assert re.search(rf"Would install .*vpce-{re.escape(VERSION)}", out.stdout), out.stdout[-2000:]
