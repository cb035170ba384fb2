#!/usr/bin/env python3
"""Container HEALTHCHECK: exit 0 when http://127.0.0.1:PORT/PATH answers 2xx within 3 s.

Usage: easerve-healthcheck PORT [PATH]   (PATH default /health). Standard library only, so it works
in every image without extra packages. Kubernetes ignores Docker's HEALTHCHECK (it has probes); this
serves `docker run` users and compose files.
"""

import sys
import urllib.request


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[1].isdigit():
        print("usage: easerve-healthcheck PORT [PATH]", file=sys.stderr)
        return 2
    path = argv[2] if len(argv) > 2 else "/health"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{argv[1]}{path}", timeout=3) as r:
            return 0 if 200 <= r.status < 300 else 1
    except OSError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
