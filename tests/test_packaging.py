"""What a user who installs the package (not the editable install of .ci/setup) gets."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

import accelbatch
from accelbatch.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_checkout_imports_its_backends_without_the_editable_finder():
    """After `pip install .`, `python -m accelbatch` in the checkout imports the checkout's accelbatch/
    (the current folder comes first), which holds no backends/: the package finds the sibling folder."""
    paths = os.pathsep.join(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    code = "import accelbatch.backends.base as b, accelbatch.backends.cpu; print(b.__file__)"
    # -S: no site-packages .pth files, so no editable install's finder; torch comes from PYTHONPATH
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": paths},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == os.path.join(ROOT, "backends", "base.py")


def test_version_option_says_the_installed_version(capsys):
    with pytest.raises(SystemExit) as end:
        main(["--version"])
    assert end.value.code == 0
    assert capsys.readouterr().out.strip() == f"accelbatch {importlib.metadata.version('accelbatch')}"
    assert accelbatch.__version__ == importlib.metadata.version("accelbatch")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_sdist_holds_the_whole_project_and_the_wheel_its_license(tmp_path, monkeypatch):
    build_meta = pytest.importorskip("setuptools.build_meta")
    if not os.path.exists(os.path.join(ROOT, ".git")):  # an unpacked sdist: no file list to check against
        pytest.skip("compares the sdist with the files git tracks: run it in a git checkout")
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()) | {"LICENSE", "MANIFEST.in"}
    source = tmp_path / "source"  # the tracked files only: no egg-info of an earlier build adds to the list
    for name in tracked:
        if os.path.isfile(os.path.join(ROOT, name)):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(ROOT, name), source / name)
    monkeypatch.chdir(source)
    sdist = tmp_path / build_meta.build_sdist(str(tmp_path))
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {n for n in tracked if n.split("/")[0] in ("tests", "examples", "bench", ".ci", "accelbatch", "backends")}
    assert wanted and not wanted - names, sorted(wanted - names)[:5]
    assert "LICENSE" in names
    wheel = tmp_path / build_meta.build_wheel(str(tmp_path))
    with zipfile.ZipFile(wheel) as archive:
        wheel_names = archive.namelist()
        metadata = archive.read(next(n for n in wheel_names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Classifier: License :: OSI Approved :: MIT License" in metadata.splitlines()  # pip show, scanners
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in wheel_names)
    assert "accelbatch/backends/base.py" in wheel_names and not any(n.startswith("tests/") for n in wheel_names)
