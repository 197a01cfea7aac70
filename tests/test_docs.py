"""The documentation site: its strict build (a broken link, a missing page, a stale API name in the
reference fails it) and the Python code blocks of its pages, run as a reader would run them — each
page's blocks in order, in a child process whose working directory holds the ``data/`` shards the
examples name. A block that needs what the tests cannot give (a GPU, torchrun's processes, a
remote store) is marked just before it with ``<!-- not run: why -->``; every other one must run.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = os.path.join(ROOT, "docs")
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\s*\n)?```python\n(.*?)```", re.S)


def pages() -> list[str]:
    """The site's pages and the README, relative to docs/."""
    found = [*glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True), os.path.join(ROOT, "README.md")]
    return sorted(os.path.relpath(p, DOCS) for p in found)


def blocks(page: str) -> list[str]:
    with open(os.path.join(DOCS, page)) as f:
        return [code for skip, code in BLOCK.findall(f.read()) if not skip]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    """A directory with the shards the examples read — ``data/train-{000000..000007}.tar`` (8 x 8
    small photos, 10 classes; also as ``.demo-data/``) and ``data/val-{000000..000001}.tar`` — and
    ``pipelines/``."""
    import gpupipe as gp
    from gpupipe.testing import encode_jpeg, synthetic_image

    root = tmp_path_factory.mktemp("docs")
    os.makedirs(root / "data")
    os.symlink(os.path.join(ROOT, "pipelines"), root / "pipelines")  # the recipes, as from the repository's root
    os.symlink("data", root / ".demo-data")  # where `make demo` writes its shards (README's example reads them)
    for split, shards in (("train", 8), ("val", 2)):
        with gp.ShardWriter(str(root / "data" / f"{split}-%06d.tar"), max_count=8) as w:
            for i in range(8 * shards):
                w.write(f"{split}{i:04d}", {"jpg": encode_jpeg(synthetic_image(i, size=(64, 80))), "cls": i % 10})
    return str(root)


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()


@pytest.mark.parametrize("page", [p for p in pages() if blocks(p)])
def test_the_code_of_each_page_runs(page, workdir):
    """Each block runs to its end (a line printed after each says so: none ends the page early,
    even with exit status 0), and no traceback is printed (a thread's or a child's included)."""
    page_blocks = blocks(page)
    code = "\n\n".join(f"{b}\nprint('<docs: block {i} ran>', flush=True)" for i, b in enumerate(page_blocks))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=workdir, env=env,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, f"{page}:\n{code}\n---\n{out.stderr[-3000:]}"
    ran = [int(i) for i in re.findall(r"<docs: block (\d+) ran>", out.stdout)]
    assert ran == list(range(len(page_blocks))), f"{page}: blocks {ran} of {len(page_blocks)} ran\n{out.stdout[-3000:]}"
    assert "Traceback" not in out.stderr, f"{page}:\n{out.stderr[-3000:]}"


def test_the_api_reference_lists_every_public_transform_and_field():
    """``docs/reference/api.md`` names each of ``gp.transforms.__all__`` and ``gp.fields.__all__``."""
    from gpupipe import fields, transforms

    with open(os.path.join(DOCS, "reference", "api.md")) as f:
        listed = set(re.findall(r"^\s+- (\w+)$", f.read(), re.M))
    assert not (set(transforms.__all__) | set(fields.__all__)) - listed
