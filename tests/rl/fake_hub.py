"""A local stand-in for the Hugging Face Hub, enough for ``HfApi.create_repo`` + ``upload_folder``.

It speaks the calls those make (read from huggingface_hub's ``hf_api``/``_commit_api``):
``POST /api/repos/create``; ``POST /api/validate-yaml`` for a ``README.md`` (its front matter
must be a YAML mapping, as on the Hub); ``POST /api/models/{repo}/preupload/{rev}``, answered with
``uploadMode: regular`` for every file (the Hub decides the mode, so the client then sends the
bytes inline, base64, in the commit: no LFS or Xet storage to fake); and
``POST /api/models/{repo}/commit/{rev}`` (ndjson: a header line, then one line per file). It
checks the bearer token and records every repo, commit and file, so tests can read back exactly
what arrived.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

USER = "tester"  # the account the token belongs to: where a repo named without an org goes


@dataclass
class Repo:
    private: bool | None
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)  # commit summaries, oldest first


class FakeHub:
    """``with FakeHub(token) as hub:`` serves on ``hub.endpoint`` until the block ends."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.cards: list[str] = []  # README.md contents validated
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                hub.requests.append(("POST", path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                if path == "/api/repos/create":
                    return self._create(json.loads(body))
                if path == "/api/validate-yaml":
                    return self._validate_card(json.loads(body)["content"])
                parts = path.split("/")  # ['', 'api', 'models', ns, name, op, rev]
                if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] in ("preupload", "commit"):
                    repo = hub.repos.get(f"{parts[3]}/{parts[4]}")
                    if repo is None:
                        return self._reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    if parts[5] == "preupload":
                        files = json.loads(body)["files"]
                        return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                            "shouldIgnore": False} for f in files]})
                    return self._commit(f"{parts[3]}/{parts[4]}", repo, body)
                return self._reply(404, {"error": f"no route {path}"})

            def _create(self, req: dict) -> None:
                if req.get("type", "model") != "model":
                    return self._reply(400, {"error": "only model repos here"})
                repo_id = f"{req.get('organization') or USER}/{req['name']}"
                if repo_id in hub.repos:
                    return self._reply(409, {"error": "You already created this model repo",
                                             "url": f"{hub.endpoint}/{repo_id}"})
                private = req.get("private")
                if private is None and "visibility" in req:
                    private = req["visibility"] == "private"
                hub.repos[repo_id] = Repo(private=private)
                return self._reply(200, {"url": f"{hub.endpoint}/{repo_id}"})

            def _validate_card(self, content: str) -> None:
                hub.cards.append(content)
                if content.startswith("---\n"):
                    try:
                        meta = yaml.safe_load(content[4:content.index("\n---", 4)])
                    except (ValueError, yaml.YAMLError) as e:
                        return self._reply(400, {"errors": [{"message": f"bad front matter: {e}"}]})
                    if not isinstance(meta, dict):
                        return self._reply(400, {"errors": [{"message": "front matter is not a mapping"}]})
                return self._reply(200, {"warnings": []})

            def _commit(self, repo_id: str, repo: Repo, body: bytes) -> None:
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                if not lines or lines[0]["key"] != "header":
                    return self._reply(400, {"error": "commit payload must start with a header"})
                for line in lines[1:]:
                    if line["key"] != "file" or line["value"].get("encoding") != "base64":
                        return self._reply(400, {"error": f"this hub takes only inline files, got {line['key']}"})
                for line in lines[1:]:
                    repo.files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                repo.commits.append(lines[0]["value"]["summary"])
                oid = f"{len(repo.commits):040x}"
                return self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
