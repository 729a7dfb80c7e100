"""A stand-in for `vllm serve` that replays recorded vLLM output (see tests/data/fake_vllm)."""

import http.server
import json
import os
import signal
import sys
import time
from pathlib import Path

LOGS = Path(os.environ["FAKE_VLLM_LOGS"])
FLAGS = [
    "--host",
    "--port",
    "--dtype",
    "--kv-cache-dtype",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--attention-backend",
    "--served-model-name",
    "--seed",
    "--enforce-eager",
    "--api-key",
]


def _print_log(name):
    for line in (LOGS / f"{name}.log").read_text().splitlines():
        print(line, flush=True)
        time.sleep(0.01)


def _arg(argv, flag, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def _serve(argv):
    model = argv[0]
    port = int(_arg(argv, "--port", "8000"))
    host = _arg(argv, "--host", "127.0.0.1")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": model}]}).encode()
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # the 1-token request a start sends after /health
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            if os.environ.get("FAKE_VLLM_DEAD_ENGINE"):  # healthy, then the engine dies
                _print_log(os.environ["FAKE_VLLM_DEAD_ENGINE"])
                status, body = 500, {"error": {"message": "EngineCore encountered an issue."}}
            elif self.path == "/v1/completions":
                status = 200
                body = {"object": "text_completion", "model": model,
                        "choices": [{"index": 0, "text": " 3", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 2, "completion_tokens": 1}}  # fmt: skip
            else:
                status, body = 404, {"error": {"message": "not found"}}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            print("INFO:     " + fmt % args, flush=True)

    server = http.server.HTTPServer((host, port), Handler)
    print("INFO:     Application startup complete.", flush=True)
    server.serve_forever()


def main():
    argv = sys.argv[1:]
    if not argv or argv[0] != "serve":
        print("usage: vllm serve [model_tag] [options]", file=sys.stderr)
        return 2
    argv = argv[1:]
    if argv and argv[0].startswith("--help"):
        print("usage: vllm serve [model_tag] [options]\n\noptions:")
        for flag in FLAGS:
            print(f"  {flag} VALUE")
        return 0
    scenario = os.environ.get("FAKE_VLLM_SCENARIO", "serve")
    print(f"fake vllm: {' '.join(argv)}", flush=True)
    if scenario == "fail_oom_killed":
        _print_log(scenario)
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario.startswith("fail_"):
        _print_log(scenario)
        return 1
    if scenario == "hang":
        _print_log("start_0.29")
        while True:
            time.sleep(1)
    if scenario == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _print_log("start_" + os.environ.get("FAKE_VLLM_LOG", "0.29"))
    _serve(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
