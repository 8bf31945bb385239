"""The llama.cpp benchmark peers: where they are, whether they are installed, how to build them.

Both peers come from ONE source: the llama-cpp-python source distribution on PyPI, which vendors
llama.cpp's source. Its version is pinned here, in `LLAMA_CPP_PYTHON_VERSION` (pyproject.toml's
`peers` extra repeats it; a test checks that the two agree).

- `llama_cpp` (llama-cpp-python, llama.cpp's Python API): `pip install -e .[peers]`, which
  compiles llama.cpp from the sdist (about 9 minutes on 2 cores). Used for batch-1 runs.
- `llama-server` (llama.cpp's C++ OpenAI-compatible server, with parallel slots and continuous
  batching): built here from the same sdist's `vendor/llama.cpp` with cmake into
  `~/.cache/tokenmill/peers/llama.cpp-<version>/bin/llama-server` (about 6 minutes on 2 cores).
  Used for concurrent load. (llama-cpp-python's own Python server serves one request at a time,
  so it is not a fair peer under load.) `llama-quantize`, llama.cpp's own quantizer, is built beside
  it in the same build: `bench compare --quant-types` makes every GGUF type from the same weights
  with it.

Both are compiled with native CPU flags (`-DGGML_NATIVE=ON`, i.e. `-march=native`).
`scripts/install-peers.sh` installs both; `python -m tokenmill.bench.peers status|build-llama-server`
reports on them or builds the server. Nothing here runs at import time or downloads anything
unless asked to build.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.cache import cache_root
from tokenmill.errors import TokenmillError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"   # the one pin of both peers (pyproject's `peers` extra must match)
# llama.cpp options for the server build: native CPU code, a static binary (relocatable into the
# cache), no HTTPS, no web UI (its prebuilt assets would be downloaded), nothing but LLAMA_TOOLS.
LLAMA_SERVER_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]
# The flags for pip's build of llama-cpp-python (CMAKE_ARGS): native code, no multimodal library.
LLAMA_CPP_PYTHON_CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
LLAMA_SERVER_ENV = "TOKENMILL_LLAMA_SERVER"    # an explicit llama-server binary (wins over the cache)
LLAMA_TOOLS = ("llama-server", "llama-quantize")   # the binaries build_llama_server builds

INSTALL_HINT = "scripts/install-peers.sh (both peers), or: pip install -e .[peers] (llama_cpp only)"
SERVER_HINT = ("scripts/install-peers.sh, or: python -m tokenmill.bench.peers build-llama-server "
               "(or `tokenmill bench compare --build-peers`; about 6 minutes on 2 cores)")


@dataclass
class PeerStatus:
    name: str
    available: bool
    version: str | None
    where: str | None      # the binary or the package folder
    detail: str            # what was found, or why it is missing and how to install it


REPACK_ENV = "TOKENMILL_LLAMA_REPACK"


def llama_repack() -> bool:
    """Do the llama.cpp peers repack weights (llama.cpp's default: its "extra buffer types", the AMX
    tiles and the interleaved CPU layouts, its fastest CPU path)? Not on a CPU with AMX: there
    llama.cpp's AMX matmul crashes at the first evaluation (seen on this project's Sapphire Rapids
    machines with Q4_1 and Q8_0, in llama-cpp-python and llama-server alike, as a segfault and, with
    the pinned build, as an illegal instruction; llama.cpp issue 20824), so the peer would give no
    number at all. $TOKENMILL_LLAMA_REPACK = 1 / 0 decides instead."""
    from tokenmill.kernels import cpu_flags

    chosen = os.environ.get(REPACK_ENV)
    if chosen is not None:
        return chosen.strip().lower() not in ("0", "false", "no", "off", "")
    return "amx_int8" not in cpu_flags().split()


def print_repack_note(repack: bool | None) -> None:
    """The line a bench's report prints when its llama.cpp peers ran without repacking (llama_repack)."""
    if repack is False:
        print(f"llama.cpp: weight repacking off (--no-repack; its AMX path crashes on this CPU, llama.cpp issue 20824; "
              f"{REPACK_ENV}=1 turns it on)")


def peers_dir() -> Path:
    return cache_root() / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def cached_llama_server() -> Path:
    """Where `build_llama_server` puts the binary (it may not be there)."""
    return peers_dir() / "bin" / "llama-server"


def llama_quantize_status() -> PeerStatus:
    """Is llama.cpp's `llama-quantize` built into the cache (beside llama-server)?"""
    path = peers_dir() / "bin" / "llama-quantize"
    if not (path.is_file() and os.access(path, os.X_OK)):
        return PeerStatus("llama.cpp (llama-quantize)", False, None, None,
                          f"not built ({path}): build it with {SERVER_HINT}")
    version = _read_build_info(path.parent.parent).get("llama_cpp_python_version")
    return PeerStatus("llama.cpp (llama-quantize)", True, version, str(path),
                      f"{path} (built from the llama-cpp-python {version} sdist)")


def llama_cpp_python_status() -> PeerStatus:
    """Is llama-cpp-python importable (found without importing it: loading its library is slow)?"""
    name = "llama.cpp (llama_cpp)"
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        return PeerStatus(name, False, None, None, f"not installed: install it with {INSTALL_HINT}")
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = None
    where = str(Path(spec.origin).parent) if spec.origin else None
    detail = f"llama-cpp-python {version}"
    if version != LLAMA_CPP_PYTHON_VERSION:
        detail += f" (tokenmill pins {LLAMA_CPP_PYTHON_VERSION}; the llama-server build uses that version)"
    return PeerStatus(name, True, version, where, detail)


def llama_server_status(explicit: str | None = None) -> PeerStatus:
    """Is there a llama-server binary: `explicit` (a path given by the user), else
    $TOKENMILL_LLAMA_SERVER, else the one built into the cache?"""
    name = "llama.cpp (llama-server)"
    given_by = "--llama-server" if explicit else f"${LLAMA_SERVER_ENV}"
    explicit = explicit or os.environ.get(LLAMA_SERVER_ENV)
    path = Path(explicit) if explicit else cached_llama_server()
    if not (path.is_file() and os.access(path, os.X_OK)):
        why = f"{given_by} {explicit} is not an executable file" if explicit else f"not built ({path})"
        return PeerStatus(name, False, None, None, f"{why}: build it with {SERVER_HINT}")
    info = _read_build_info(path.parent.parent)
    version = info.get("llama_cpp_python_version") if not explicit else None
    if explicit:
        detail = f"{path} (given by {given_by})"
    else:
        detail = f"{path} (built from the llama-cpp-python {version} sdist)"
    return PeerStatus(name, True, version, str(path), detail)


def llama_server_for(explicit: str | None, wanted: bool, model: str) -> PeerStatus | None:
    """A bench's llama-server peer: None when not asked for (`wanted`), else its status, unavailable
    (and said so) when it is not built or the model is not a .gguf file."""
    if not wanted:
        return None
    server = llama_server_status(explicit)
    if server.available and not model.endswith(".gguf"):
        server = PeerStatus(server.name, False, None, None, f"needs a .gguf model, got {model}")
    if not server.available:
        print(f"skipping llama-server: {server.detail}", flush=True)
    return server


def derived_gguf(model: str, folder: str, tag: str) -> Path:
    """Where a bench keeps a file it made from the GGUF `model` (a requantized or relabelled copy):
    cache_root()/folder, named by the source's name, size and time (a changed source makes a new one)
    and `tag`. The caller writes it there once (atomically) when it is missing."""
    stat = Path(model).stat()
    return cache_root() / folder / f"{Path(model).stem}-{stat.st_size}-{stat.st_mtime_ns}-{tag}.gguf"


# The GGUF types `bench compare --quant-types` makes with llama-quantize: those a user is likely to download.
QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_K_M", "Q4_K_M", "Q6_K", "Q8_0", "F16"]


def quantized_copy(model: str, qtype: str, threads: int) -> str:
    """`model` requantized to `qtype` by llama.cpp's own llama-quantize (with --allow-requantize: the
    source may itself be quantized, as the embedded model is; the copy then carries the source's
    rounding too), made once in the cache folder. llama-quantize picks each tensor's type as it does
    for any user (e.g. Q4_K_M keeps some tensors in Q6_K, and rows not a multiple of 256 fall back to
    other types)."""
    status = llama_quantize_status()
    if not status.available:
        raise TokenmillError(f"llama-quantize is {status.detail}")
    target = derived_gguf(model, "quant-types", qtype)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([status.where, "--allow-requantize", model, str(partial), qtype, str(threads)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise TokenmillError(f"llama-quantize {qtype} failed ({done.returncode}): {done.stderr[-2000:]}")
        partial.replace(target)
    return str(target)


def guarded(what: str, fn, *args: Any) -> Any:
    """fn(*args) for a peer: a peer that fails is a cell of the table, not the end of the run (its
    result is then {"error": ...})."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"  {what} failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:4000]}


def _read_build_info(folder: Path) -> dict:
    try:
        return json.loads((folder / "build-info.json").read_text())
    except (OSError, ValueError):
        return {}


# ---- building llama-server -----------------------------------------------------------------------

def find_cmake() -> str:
    """cmake on PATH, else the one the PyPI `cmake` package installs next to this Python."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found:
        return found
    raise TokenmillError("cmake is not installed: `apt-get install cmake` (as root) or `pip install cmake`")


def _run(command: list[str], log, cwd: Path | None = None) -> None:
    log.write(f"\n$ {' '.join(command)}\n".encode())
    log.flush()
    code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd).returncode
    if code != 0:
        raise TokenmillError(f"`{' '.join(command[:4])} ...` failed with status {code}; see {log.name}")


def build_llama_server(jobs: int | None = None, force: bool = False, keep_source: bool = False) -> Path:
    """Download the pinned llama-cpp-python sdist (pip, from the package index), build llama.cpp's
    `llama-server` and `llama-quantize` (LLAMA_TOOLS) from its vendored source with native CPU flags,
    and install the binaries into the cache. Returns llama-server's path; does nothing when both are
    already there (unless `force`)."""
    dest = peers_dir()
    binary = dest / "bin" / "llama-server"
    if all((dest / "bin" / tool).is_file() for tool in LLAMA_TOOLS) and not force:
        return binary
    cmake = find_cmake()
    jobs = jobs or os.cpu_count() or 1
    dest.mkdir(parents=True, exist_ok=True)
    log_path = dest / "build-llama-server.log"
    start = time.time()
    print(f"building {' and '.join(LLAMA_TOOLS)} from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} "
          f"(log: {log_path}) ...", flush=True)
    with open(log_path, "wb") as log, tempfile.TemporaryDirectory(prefix="llama-server-", dir=dest) as tmp:
        work = Path(tmp)
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-cache-dir",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(work)], log)
        sdists = list(work.glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise TokenmillError(f"pip download gave {[p.name for p in work.iterdir()]}, not one sdist")
        with tarfile.open(sdists[0]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(work, filter="data")
            else:   # Python < 3.10.12: no extraction filters
                tar.extractall(work)  # noqa: S202 - a package-index sdist, extracted in a fresh temp dir
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        _run([cmake, "-S", str(source), "-B", str(build), *LLAMA_SERVER_CMAKE_FLAGS], log)
        _run([cmake, "--build", str(build), "--target", *LLAMA_TOOLS, "-j", str(jobs)], log)
        (dest / "bin").mkdir(exist_ok=True)
        for tool in LLAMA_TOOLS:
            built = next((p for p in build.rglob(tool) if p.is_file() and os.access(p, os.X_OK)), None)
            if built is None:
                raise TokenmillError(f"the build finished but produced no {tool} binary; see {log_path}")
            shutil.copy2(built, dest / "bin" / tool)
        if keep_source:
            shutil.copytree(source, dest / "src", dirs_exist_ok=True)
    info = {"llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION, "cmake_flags": LLAMA_SERVER_CMAKE_FLAGS,
            "build_seconds": round(time.time() - start), "jobs": jobs, "machine": platform.machine(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (dest / "build-info.json").write_text(json.dumps(info, indent=2))
    print(f"built {', '.join(LLAMA_TOOLS)} in {dest / 'bin'} in {info['build_seconds']} s", flush=True)
    return binary


# ---- `python -m tokenmill.bench.peers` -----------------------------------------------------------

def print_status() -> bool:
    """Print one line per peer; True when every peer is there."""
    statuses = [llama_cpp_python_status(), llama_server_status(), llama_quantize_status()]
    for s in statuses:
        print(f"{s.name:<26} {'ok' if s.available else 'MISSING':<8} {s.detail}")
    return all(s.available for s in statuses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.peers", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="which peers are installed (exit status 1 when one is missing)")
    sub.add_parser("version", help="print the pinned llama-cpp-python version")
    sub.add_parser("cmake-args", help="print the CMAKE_ARGS for pip's build of llama-cpp-python")
    b = sub.add_parser("build-llama-server", help="build llama-server and llama-quantize from the pinned sdist "
                       "into the cache")
    b.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: all cores)")
    b.add_argument("--force", action="store_true", help="rebuild even when the binary is there")
    b.add_argument("--keep-source", action="store_true", help="also keep the llama.cpp source in the cache")
    args = parser.parse_args(argv)
    try:
        if args.command == "version":
            print(LLAMA_CPP_PYTHON_VERSION)
        elif args.command == "cmake-args":
            print(LLAMA_CPP_PYTHON_CMAKE_ARGS)
        elif args.command == "status":
            return 0 if print_status() else 1
        else:
            build_llama_server(args.jobs, args.force, args.keep_source)
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    return 0


def status_dict() -> list[dict]:
    return [asdict(s) for s in (llama_cpp_python_status(), llama_server_status(), llama_quantize_status())]


if __name__ == "__main__":
    sys.exit(main())
