#!/usr/bin/env python3
"""One QMP command to a QEMU monitor socket; prints the "return" value as JSON.

    qmp.py SOCKET COMMAND [ARGUMENTS-AS-JSON]

Exits 1 (with QEMU's error on stderr) if QEMU answers with an error, 2 if the
socket does not answer. Events QEMU sends meanwhile are skipped.
"""
import json
import socket
import sys


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    path, cmd = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) == 4 else None
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        f = s.makefile("rw")
    except OSError as e:
        print(f"qmp: {path}: {e}", file=sys.stderr)
        return 2

    def answer():
        while True:
            line = f.readline()
            if not line:
                raise OSError("QEMU closed the monitor")
            msg = json.loads(line)
            if "return" in msg or "error" in msg:
                return msg

    try:
        f.readline()  # the greeting
        f.write(json.dumps({"execute": "qmp_capabilities"}) + "\n")
        f.flush()
        answer()
        req = {"execute": cmd}
        if args is not None:
            req["arguments"] = args
        f.write(json.dumps(req) + "\n")
        f.flush()
        msg = answer()
    except (OSError, ValueError) as e:
        print(f"qmp: {path}: {e}", file=sys.stderr)
        return 2
    if "error" in msg:
        print(f"qmp: {cmd}: {msg['error'].get('desc', msg['error'])}", file=sys.stderr)
        return 1
    print(json.dumps(msg["return"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
