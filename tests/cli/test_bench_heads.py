"""`npuspec bench heads`: a chain head's teacher-forced agreement on the target's own greedy
answers, scored on answer positions only."""
import pytest
import torch

from npuspec.bench import heads
from npuspec.models.draft_loading import load_draft
from npuspec.models.loading import load_model
from npuspec.spec_decode.heads import resolve_draft
from npuspec.train.chain import dense_chain

PROMPTS = ["def fibonacci(n):\n    ", "import os\n\nclass Config:\n    def __init__(self"]


def test_agreement_scores_the_answer_positions():
    cfg, target = load_model("tiny")
    head = load_draft("eagle3", resolve_draft("tiny-eagle3"), cfg, target).float()
    seqs = heads.answers("tiny", PROMPTS, 24, 2, enforce_eager=True)
    assert [n for _, n in seqs] == [len(s) - 24 for s, _ in seqs]  # 24 answer tokens each
    acc = heads.agreement(head, target, seqs, 2)
    # a_1 by hand: row t predicts the target's token t+2 from the feature at t and the token
    # at t+1; scored: the rows serving drafts, answer tokens past the first (prefill's)
    hits = rows = same = 0
    with torch.inference_mode():
        for ids, n in seqs:
            x = torch.tensor([ids])
            logits, feats = target.forward_causal(x, aux_ids=tuple(head.aux_layer_ids), final=True)
            greedy = logits[0].argmax(-1)  # [N] the target's token after each position
            H = cfg.hidden_size
            (lh, _), = dense_chain(head, [x[:, 1:]], feats[:, :-1, :-H])
            pred = head.logits(lh)[0].argmax(-1)                           # [N-1]
            for t in range(len(ids) - 1):  # the last row: the token after the answer
                if t + 2 >= n + 1:
                    rows += 1
                    hits += int(pred[t] == greedy[t + 1])
                    same += t + 2 < len(ids) and int(greedy[t + 1] == ids[t + 2])
    assert rows == 2 * 24
    assert same >= rows - 4, (same, rows)  # the engine's greedy answers, bar near-ties
    assert acc[0] == pytest.approx(hits / rows)
    assert 0 <= acc[1] <= 1


def test_bad_flags_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        heads.main(["--head", "tiny-eagle3", "--k", "0"])
    assert "--k 0" in capsys.readouterr().err
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(Exception, match="nope.txt"):
        heads.main(["--head", "tiny-eagle3", "--prompts", missing])
