"""Background store compute of the isolated policy, per pass, with `--repeat` (a fake
engine: no model involved)."""

import torch

from holeblend_runtime.bench.runner import BenchConfig, BenchRunner
from holeblend_runtime.bench.workload import WorkloadConfig, generate_workload

# Store compute each blended send queues, done when the engine's stores are waited for.
STORE_S = 1.0


class _Store:
    def __init__(self):
        self.entries: set[str] = set()

    def keys(self):
        return set(self.entries)

    def remove(self, key):
        self.entries.discard(key)


class _Prompt:
    def __init__(self, documents):
        self.documents = tuple(documents)
        self.num_tokens = 10 * len(self.documents)


class _Prefill:
    def __init__(self):
        self.logits = torch.zeros(8)
        self.num_reused_tokens = self.num_hole_tokens = self.num_recomputed_tokens = 0
        self.ttft_s = self.request_s = 0.01
        self.reuse = None


class _Stats:
    def __init__(self, compute_s):
        self.compute_s = compute_s


class _BackgroundEngine:
    """Stores what it blends in the background, as the isolated policy does: a send queues
    `STORE_S` of compute, spent when the stores are waited for."""

    def __init__(self):
        self.store, self.queued, self.compute_s = _Store(), [], 0.0

    def build_prompt(self, system, documents, question):
        return _Prompt(documents)

    def prefill(self, prompt, mode, ratio):
        if mode != "full":
            self.queued.append(prompt.documents)
        return _Prefill()

    def score(self, prefill, token_ids):
        return torch.zeros(len(token_ids), 8)

    def generate(self, prefill, max_new_tokens):
        return [1]

    def wait_for_stores(self, timeout=None):
        for documents in self.queued:
            self.compute_s += STORE_S
            self.store.entries.update(documents)
        self.queued = []
        return True

    def store_stats(self):
        return _Stats(self.compute_s)

    def close(self):
        pass


class _Tokenizer:
    def encode(self, text):
        return [1, 2]

    def decode(self, token_ids):
        return "x"


def test_pass_three_reports_its_own_background_store_compute():
    """Each pass-3 send stores its segments again (what its pass-2 send stored is removed
    first): that compute belongs to pass 3's row, not added to pass 2's, or pass 2 looks
    twice as costly in the background and pass 3 free."""
    workload = WorkloadConfig(num_questions=2, num_documents=3)
    config = BenchConfig(workload=workload, ratios=(0.15,), modes=("hole",),
                         store_policies=("isolated",), max_new_tokens=1, repeat=True)  # fmt: skip
    runner = BenchRunner(lambda policy, entry: _BackgroundEngine(), _Tokenizer(), config)
    warm_up = generate_workload(WorkloadConfig(seed=99, num_questions=1, num_documents=3))[0]
    rows = runner.run(generate_workload(workload), show_progress=False, warm_up=warm_up)
    background = {row["pass"]: row["background_store_s_mean"] for row in rows
                  if row["mode"] == "hole"}  # fmt: skip
    assert background == {1: STORE_S, 2: STORE_S, 3: STORE_S}
