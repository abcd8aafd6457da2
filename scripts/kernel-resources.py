#!/usr/bin/env python3
"""Registers, spills and shared memory of every kernel in kernels.cu, without a GPU.

Compiles kernels.cu with NVRTC exactly as specula does at load (--std=c++17, one architecture), then runs ptxas -v
on the PTX. Needs the nvidia-cuda-nvrtc and nvidia-cuda-nvcc 13.0 wheels (pip download --no-deps, unzip):
    scripts/kernel-resources.py --nvrtc DIR_WITH_libnvrtc.so.13 --ptxas PATH_TO_ptxas [--arch sm_90]
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--nvrtc", required=True)
ap.add_argument("--ptxas", required=True)
ap.add_argument("--arch", default="sm_90")
ap.add_argument("--source", default=os.path.join(os.path.dirname(__file__), "../crates/specula/src/backend/cuda/kernels.cu"))
a = ap.parse_args()

lib = ctypes.CDLL(os.path.join(a.nvrtc, "libnvrtc.so.13"))
src = open(a.source, "rb").read()
prog = ctypes.c_void_p()
if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None) != 0:
    sys.exit("nvrtcCreateProgram failed")
opts = [f"--gpu-architecture={a.arch}".encode(), b"--std=c++17"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
size = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
lib.nvrtcGetProgramLog(prog, log)
if rc != 0:
    sys.exit("NVRTC failed:\n" + log.value.decode())
lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
ptx = ctypes.create_string_buffer(size.value)
lib.nvrtcGetPTX(prog, ptx)
with tempfile.NamedTemporaryFile("wb", suffix=".ptx", delete=False) as f:
    f.write(ptx.value)
out = subprocess.run([a.ptxas, "-v", f"-arch={a.arch}", f.name, "-o", os.devnull], capture_output=True, text=True)
name = None
for line in (out.stdout + out.stderr).splitlines():
    if "Compiling entry function" in line:
        name = line.split("'")[1]
    elif "Used" in line and name:
        print(f"{name:24s} {line.split('info    : ')[-1]}")
    elif "spill" in line and name and ("0 bytes spill stores, 0 bytes spill loads" not in line):
        print(f"{name:24s}   {line.split('info    : ')[-1]}")
sys.exit(out.returncode)
