"""PEP 517 build backend of the kvcodec package, with no build dependency.

build_wheel() writes a wheel of kvcodec/*.py plus libkvcodec.so:
  - $KVCODEC_LIBRARY, when set, is the library bundled (e.g. build/libkvcodec.so
    of a CMake build: scripts/test.sh does this, nothing is rebuilt);
  - otherwise it runs CMake on the repository this folder sits in (target
    kvcodec_shared, in $KVCODEC_BUILD_DIR or <repo>/build-python, through
    ccache when installed; extra configure arguments in $KVCODEC_CMAKE_ARGS).
The wheel is tagged for this platform (it holds a native library) and
for any Python 3 (the bindings are ctypes: no compiled Python extension).
"""
import base64
import hashlib
import os
import shlex
import shutil
import subprocess
import zipfile
from pathlib import Path

NAME, VERSION = "kvcodec", "0.1.0"
HERE = Path(__file__).resolve().parent
TAG = "py3-none-linux_x86_64"


def _library():
    env = os.environ.get("KVCODEC_LIBRARY")
    if env:
        path = Path(env)
        if not path.is_file():
            raise RuntimeError(f"KVCODEC_LIBRARY={env} is not a file (relative paths are taken from {Path.cwd()}, "
                               "pip's build folder: give an absolute path)")
        return path.resolve()
    root = HERE.parent
    if not (root / "CMakeLists.txt").is_file():
        raise RuntimeError(f"no libkvcodec.so: set KVCODEC_LIBRARY, or build from the kvcodec repository "
                           f"({root} has no CMakeLists.txt)")
    build = Path(os.environ.get("KVCODEC_BUILD_DIR", root / "build-python"))
    configure = ["cmake", "-S", str(root), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DKVCODEC_TESTS=OFF", "-DKVCODEC_BENCH=OFF"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    configure += shlex.split(os.environ.get("KVCODEC_CMAKE_ARGS", ""))
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "kvcodec_shared", "-j", str(os.cpu_count() or 1)],
                   check=True)
    return (build / "libkvcodec.so").resolve()


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
            "Summary: Compressed KV caches (KVTC, PALU, baselines) for numpy, PyTorch and transformers\n"
            "Requires-Python: >=3.9\nRequires-Dist: numpy\n")


def get_requires_for_build_wheel(config_settings=None):
    return []


def _wheel_file():
    return f"Wheel-Version: 1.0\nGenerator: kvcodec_build\nRoot-Is-Purelib: false\nTag: {TAG}\n"


INFO = f"{NAME}-{VERSION}.dist-info"


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    # Metadata without building the library (pip asks for it first).
    info = Path(metadata_directory) / INFO
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(_metadata())
    (info / "WHEEL").write_text(_wheel_file())
    return INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = {f"{NAME}/{p.name}": p.read_bytes() for p in sorted((HERE / NAME).glob("*.py"))}
    files[f"{NAME}/libkvcodec.so"] = _library().read_bytes()
    info = INFO
    files[f"{info}/METADATA"] = _metadata().encode()
    files[f"{info}/WHEEL"] = _wheel_file().encode()
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel_name = f"{NAME}-{VERSION}-{TAG}.whl"
    with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            z.writestr(zi, data, zipfile.ZIP_DEFLATED)
    return wheel_name
