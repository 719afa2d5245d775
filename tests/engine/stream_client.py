"""Stream one chat completion into a file, as it arrives, from a process of its own.

A streaming client inside the test process would hold the interpreter lock for each of its chunks, and
the test's own requests (the late one sent during the withdraw window) would wait seconds behind it.

    python -m tests.engine.stream_client URL OUT < body.json   (the key in KIMI_TEST_API_KEY)
"""

from __future__ import annotations

import os
import sys

import httpx


def main() -> None:
    url, out = sys.argv[1], sys.argv[2]
    headers = {"Authorization": f"Bearer {os.environ['KIMI_TEST_API_KEY']}", "Content-Type": "application/json"}
    with (httpx.stream("POST", url, content=sys.stdin.buffer.read(), headers=headers, timeout=120) as response,
          open(out, "wb") as sink):
        response.raise_for_status()
        for data in response.iter_raw():
            sink.write(data)
            sink.flush()


if __name__ == "__main__":
    main()
