"""Checks, in the macOS arm64 torch wheels themselves, the PyTorch MPS API that the Metal host
code (csrc/mps/mps_common.h) relies on. Runs on Linux; needs network access to PyPI and
llvm-nm / llvm-objdump (apt: llvm). Each wheel is downloaded to a temporary folder, its
headers and libtorch_cpu.dylib are read, and the folder is deleted.

For each version it prints whether
- ATen/mps/MPSStream.h declares MPSStream::commandEncoder(), endKernelCoalescing(), the inline
  queue() and getCurrentMPSStream(), and torch/mps.h get_command_buffer / get_dispatch_queue;
- libtorch_cpu.dylib exports those functions;
- MPSStream::commandEncoder() returns the stream's open encoder or makes one with
  [commandBuffer computeCommandEncoder] (its disassembly calls exactly that selector);
- MPSHooks::getCommandBuffer() (behind torch::mps::get_command_buffer) ends the coalesced
  encoder (calls endKernelCoalescing) -- False for torch 2.5-2.8.

Usage: python tools/check_macos_torch_wheels.py [VERSION ...]   (default: 2.5.0 2.8.0 2.9.0
2.10.0 2.13.0)
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

VERSIONS = ["2.5.0", "2.8.0", "2.9.0", "2.10.0", "2.13.0"]
HEADERS = {
    "torch/include/ATen/mps/MPSStream.h": [
        r"MTLComputeCommandEncoder_t commandEncoder\(\);", r"void endKernelCoalescing\(\);",
        r"dispatch_queue_t queue\(\) const", r"TORCH_API MPSStream\* getCurrentMPSStream\(\);"],
    "torch/include/torch/csrc/api/include/torch/mps.h": [
        r"get_command_buffer\(\);", r"get_dispatch_queue\(\);", r"commit\(\);"],
}
SYMBOLS = ["__ZN2at3mps19getCurrentMPSStreamEv", "__ZN2at3mps9MPSStream14commandEncoderEv",
           "__ZN2at3mps9MPSStream19endKernelCoalescingEv",
           "__ZN5torch3mps18get_command_bufferEv", "__ZN5torch3mps18get_dispatch_queueEv"]


def _disassemble(lib, symbol):
    out = subprocess.run(["llvm-objdump", "--macho", "-d", "--no-show-raw-insn", "--dis-symname",
                          symbol, lib], capture_output=True, text=True, check=True)
    return out.stdout


def check(version):
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PIP_CONSTRAINT="")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--platform", "macosx_14_0_arm64",
                        "--python-version", "3.11", f"torch=={version}", "-d", tmp],
                       check=True, env=env)
        wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            result = {"wheel": os.path.basename(wheel)}
            for header, patterns in HEADERS.items():
                text = z.read(header).decode()
                for p in patterns:
                    result[f"header {p}"] = re.search(p, text) is not None
            lib = z.extract("torch/lib/libtorch_cpu.dylib", tmp)
        nm = subprocess.run(["llvm-nm", "-gU", lib], capture_output=True, text=True, check=True)
        exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
        for s in SYMBOLS:
            result[f"exports {s}"] = s in exported
        enc = _disassemble(lib, SYMBOLS[1])
        result["commandEncoder uses computeCommandEncoder"] = "computeCommandEncoder" in enc
        hooks = _disassemble(lib, "__ZNK2at3mps8MPSHooks16getCommandBufferEv")
        result["get_command_buffer ends coalescing"] = "endKernelCoalescing" in hooks
        return result


if __name__ == "__main__":
    for v in sys.argv[1:] or VERSIONS:
        print(v, check(v))
