"""The browser UI ships in the wheel (web/ reaches the package through the chatserve/web link),
so a non-editable install serves it too."""

import subprocess
import sys
import zipfile
from pathlib import Path

from chatserve.server.app import WEB_DIR

REPO = Path(__file__).resolve().parents[2]


def test_the_ui_is_found_through_the_package():
    assert (WEB_DIR / "index.html").is_file() and (WEB_DIR / "chat.js").is_file()


def test_the_wheel_carries_the_ui(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("chatserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    web = {path.relative_to(REPO).as_posix() for path in (REPO / "web").rglob("*") if path.is_file()}
    assert {f"chatserve/{path}" for path in web} <= names  # the modules, vendored libraries and licences
    assert {"chatserve/web/index.html", "chatserve/web/store.js", "chatserve/web/vendor/purify.min.js"} <= names
    assert "chatserve/data/prompts.json" in names
