"""Train a hidden-state drafter (EAGLE-3, EAGLE, Medusa, MTP, DFlash, DSpark) for a target model
on one machine.

    from npuspec.models import load_model, load_tokenizer
    from npuspec.train import TrainConfig, CorpusData, stdlib_corpus, train, save_trained

    tcfg, target = load_model("tiny")
    cfg = TrainConfig(method="eagle3", steps=800)
    corpus = stdlib_corpus(load_tokenizer("tiny"))
    data = CorpusData(target, corpus.train, corpus.val, aux_ids=...)   # or FileData(...)
    result = train(target, data, cfg, state_dir="out/train_state")     # -> TrainResult
    save_trained(result.module, "out")                                  # load_draft reads it

`npuspec train-draft` (npuspec/cli/train_draft.py, docs/train_draft.md) is the command line.

The module trained is exactly the serving module (`EagleDraft`, `Eagle3Draft`, `MedusaHeads`,
`MTPDraft`, `DFlashDraft`, `DSparkDraft`): its own parameters are the ones optimized, and
`save_draft` writes them. What the draft shares with the target (its embedding, its LM head)
is the target's own tensor and stays frozen.

    config.py      TrainConfig: the run's settings, checked
    data.py        Batch; the stdlib corpus run through the target; extract_hidden_states files
    chain.py       EAGLE-3 / EAGLE / MTP / Medusa: the dense forward (equal to the paged one)
                   and the losses
    block.py       DFlash / DSpark: their dense forward, losses and held-out metric (serving's
                   verification of greedy blocks)
    checkpoint.py  resumable checkpoints (no pickles; resuming is bit for bit)
    trainer.py     build_draft, the loop (train), held-out acceptance, save_trained

Held-out acceptance (the chain and Medusa methods): teacher-forced top-1 agreement a_k of the
draft's argmax with the target's argmax at draft position k (k = 1..K), and the implied expected
acceptance length 1 + sum_k prod_{i<=k} a_i (tokens per target step of a K-token chain).

The package sits above npuspec.engine (it reads the engine's hidden-state files) and below
npuspec.cli (docs/design.md).
"""
from npuspec.train.chain import ChainObjective, dense_chain, dense_medusa, ttt_attention
from npuspec.train.config import METHODS, TrainConfig
from npuspec.train.data import Batch, CorpusData, FileData, hidden_state_files, stdlib_corpus
from npuspec.train.trainer import (TrainResult, build_draft, draft_vocab,
                                   expected_acceptance_length, save_trained, train)

__all__ = ["Batch", "ChainObjective", "CorpusData", "FileData", "METHODS", "TrainConfig",
           "TrainResult", "build_draft", "dense_chain", "dense_medusa", "draft_vocab",
           "expected_acceptance_length", "hidden_state_files", "save_trained", "stdlib_corpus",
           "train", "ttt_attention"]
