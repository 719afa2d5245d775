import ctypes
import sys

try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    sys.exit(f"libcuda.so.1 cannot be loaded: {exc}")
count = ctypes.c_int()
for call, args in (("cuInit", (0,)), ("cuDeviceGetCount", (ctypes.byref(count),))):
    rc = getattr(cuda, call)(*args)
    if rc != 0:
        sys.exit(f"{call} failed with CUDA error {rc}" + (" (fabric manager not ready)" if rc == 802 else ""))
print(count.value)
