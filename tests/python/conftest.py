import os
import subprocess
import sys
from pathlib import Path

import pytest

# The tests import the package from the source tree (built in place by
# scripts/test.sh) and the shared helpers beside this file.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs (CI runs as root; elsewhere the tests using it skip, saying why)."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
