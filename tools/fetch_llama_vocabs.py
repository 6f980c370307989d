"""Fetch the vocabularies llama.cpp tests its tokenizers on, for tests/llm/test_tokenizer_parity.py.

    python tools/fetch_llama_vocabs.py DIR      # then: FUCINA_LLAMA_VOCABS=DIR pytest -m parity tests/llm

Downloads the llama-cpp-python source distribution with pip (no build, no dependencies) and extracts only
vendor/llama.cpp/models/ggml-vocab-*.gguf with their .gguf.inp / .gguf.out files into DIR (about 75 MB).
"""
from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"   # the llama-cpp-python the parity suite uses as its oracle elsewhere
MEMBER = "*/vendor/llama.cpp/models/ggml-vocab-*"


def fetch(dest: Path, version: str = VERSION) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise SystemExit(f"expected one llama-cpp-python sdist in {tmp}, found {[p.name for p in sdists]}")
        written = []
        with tarfile.open(sdists[0]) as tar:
            for member in tar:
                if not (member.isfile() and fnmatch.fnmatch(member.name, MEMBER)):
                    continue
                target = dest / Path(member.name).name   # flat: no path from the archive is trusted
                with tar.extractfile(member) as src:
                    target.write_bytes(src.read())
                written.append(target)
    if not written:
        raise SystemExit(f"no {MEMBER} files in the llama-cpp-python {version} sdist")
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--version", default=VERSION)
    args = ap.parse_args()
    files = fetch(args.dest, args.version)
    print(f"{len(files)} files in {args.dest}")


if __name__ == "__main__":
    main()
