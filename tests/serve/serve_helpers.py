"""Helpers of the server tests: a real `npuspec serve` process on 127.0.0.1 (a free port),
the chat checkpoint, the metrics reader."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

EAGER = json.dumps({"backend": "eager"})  # no Inductor C++ build: the server starts in seconds
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def render_chatml(messages, add_generation_prompt=True) -> str:
    """CHATML by hand, to check the server's Jinja rendering against."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def make_chat_model(d) -> str:
    """The embedded model with a ChatML chat template in tokenizer_config.json."""
    from npuspec.models import TINY_MODEL_DIR
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(os.path.join(TINY_MODEL_DIR, f), d / f)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return str(d)


class Server:
    def __init__(self, args, timeout=240):
        cmd = [sys.executable, "-m", "npuspec.cli", "serve", *args, "--port", "0",
               "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr),
                         daemon=True).start()
        line = self.proc.stdout.readline()  # printed before the model loads
        if " on http://" not in line:
            self.proc.wait(30)
            raise RuntimeError(f"server did not start: {line!r} {''.join(self.stderr)}")
        self.url = line.strip().rsplit(" on ", 1)[1]
        self._wait_ready(timeout)

    @staticmethod
    def _drain(stream, into):
        for line in stream:
            into.append(line)

    def _wait_ready(self, timeout):
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {''.join(self.stderr)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout} s: {''.join(self.stderr)[-2000:]}")

    def metrics(self) -> dict:
        """/metrics as {(name, frozenset(labels)): value}."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                out[(s.name, frozenset(labels.items()))] = s.value
        return out

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)
