#!/usr/bin/env python3
"""A Hugging Face Hub look-alike for testing `glmflash-node download` (stdlib only).

Serves model repos from a directory:

    ROOT/ORG/NAME/COMMIT/<files>      one directory per commit (40 hex chars)
    ROOT/ORG/NAME/refs.json           {"main": "COMMIT", ...} branch and tag names

Endpoints, as the Hub answers them:

    GET /api/models/ORG/NAME/revision/REV[?blobs=true]   {"id", "sha", "siblings": [...]}
        siblings carry size, blobId (git blob sha1) and, for *.safetensors, lfs.sha256
    GET /ORG/NAME/resolve/REV/FILE     the file; *.safetensors are redirected (302) to
                                       /cdn/ORG/NAME/COMMIT/FILE like the Hub's LFS CDN
    errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo)

Range requests (bytes=N- and bytes=N-M) get 206 with Content-Range. Options:
    --token T        every request needs "Authorization: Bearer T" (401 GatedRepo otherwise)
    --throttle-bps N send file bodies at about N bytes/s
    --drop-after N   once per file, close the connection after N body bytes
    --corrupt FILE   flip one byte of FILE in every response
Each request is logged to stderr as one JSON line: method, path, range, status.
Prints "listening PORT" on stdout once ready (--port 0 picks a free port).
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub:
    def __init__(self, args):
        self.root = args.root
        self.token = args.token
        self.throttle = args.throttle_bps
        self.drop_after = args.drop_after
        self.corrupt = set(args.corrupt or [])
        self.dropped = set()
        self.lock = threading.Lock()

    def resolve(self, org, name, rev):
        """(repo dir, commit) or an error code."""
        repo = os.path.join(self.root, org, name)
        if not os.path.isdir(repo):
            return None, "RepoNotFound"
        refs = {}
        refs_path = os.path.join(repo, "refs.json")
        if os.path.exists(refs_path):
            with open(refs_path) as f:
                refs = json.load(f)
        commit = refs.get(rev, rev)
        if len(commit) != 40 or not os.path.isdir(os.path.join(repo, commit)):
            return None, "RevisionNotFound"
        return os.path.join(repo, commit), commit


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub = None

    def log_message(self, fmt, *args):
        pass

    def log(self, status):
        line = {
            "method": self.command,
            "path": self.path,
            "range": self.headers.get("Range"),
            "auth": self.headers.get("Authorization") is not None,
            "status": status,
        }
        sys.stderr.write(json.dumps(line) + "\n")
        sys.stderr.flush()

    def error(self, status, code, message):
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.end_headers()
        self.wfile.write(body)
        self.log(status)

    def authorized(self):
        if self.hub.token is None:
            return True
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self.error(401, "GatedRepo", "Access to this model is restricted; pass a valid token.")
        return False

    def do_GET(self):
        path = unquote(urlsplit(self.path).path)
        parts = [p for p in path.split("/") if p]
        if not self.authorized():
            return
        if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] == "revision":
            return self.info(parts[2], parts[3], parts[5])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve_file(parts[0], parts[1], parts[3], "/".join(parts[4:]))
        if len(parts) >= 5 and parts[0] == "cdn":
            return self.send_file(parts[1], parts[2], parts[3], "/".join(parts[4:]))
        self.error(404, "EntryNotFound", f"no route for {path}")

    def info(self, org, name, rev):
        repo, commit = self.hub.resolve(org, name, rev)
        if repo is None:
            return self.error(404, commit, f"{org}/{name}: revision {rev} ({commit})")
        siblings = []
        for fname in sorted(os.listdir(repo)):
            with open(os.path.join(repo, fname), "rb") as f:
                data = f.read()
            s = {"rfilename": fname, "size": len(data), "blobId": git_blob_sha1(data)}
            if fname.endswith(".safetensors"):
                s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"id": f"{org}/{name}", "sha": commit, "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.log(200)

    def resolve_file(self, org, name, rev, fname):
        repo, commit = self.hub.resolve(org, name, rev)
        if repo is None:
            return self.error(404, commit, f"{org}/{name}: revision {rev}")
        if not os.path.isfile(os.path.join(repo, fname)):
            return self.error(404, "EntryNotFound", f"{fname} not in {org}/{name}@{rev}")
        if fname.endswith(".safetensors"):
            self.send_response(302)
            self.send_header("Location", f"/cdn/{org}/{name}/{commit}/{fname}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.log(302)
            return
        self.send_file(org, name, commit, fname)

    def send_file(self, org, name, commit, fname):
        repo, commit = self.hub.resolve(org, name, commit)
        full = os.path.join(repo, fname) if repo else None
        if full is None or not os.path.isfile(full):
            return self.error(404, "EntryNotFound", f"{fname}")
        with open(full, "rb") as f:
            data = bytearray(f.read())
        etag = hashlib.sha256(data).hexdigest() if fname.endswith(".safetensors") \
            else git_blob_sha1(bytes(data))
        if fname in self.hub.corrupt and data:
            data[len(data) // 2] ^= 0xFF
        size = len(data)
        start, end = 0, size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            spec = rng.removeprefix("bytes=")
            a, _, b = spec.partition("-")
            start = int(a)
            end = int(b) if b else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.log(416)
                return
            status = 206
        body = bytes(data[start:end + 1])
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", commit)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        self.log(status)
        drop = None
        key = (commit, fname)
        if self.hub.drop_after is not None:
            with self.hub.lock:
                if key not in self.hub.dropped and len(body) > self.hub.drop_after:
                    self.hub.dropped.add(key)
                    drop = self.hub.drop_after
        chunk = 16384
        sent = 0
        t0 = time.monotonic()
        try:
            while sent < len(body):
                n = chunk if drop is None else min(chunk, drop - sent)
                if n <= 0:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body[sent:sent + n])
                sent += n
                if self.hub.throttle:
                    ahead = sent / self.hub.throttle - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token")
    ap.add_argument("--throttle-bps", type=int)
    ap.add_argument("--drop-after", type=int)
    ap.add_argument("--corrupt", action="append")
    args = ap.parse_args()
    Handler.hub = Hub(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
