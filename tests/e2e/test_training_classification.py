"""A classification head trained on the client on top of the swarm (`AutoDistributedModelForSequenceClassification`,
with soft prompts tuned at the same time) on a real 2-server swarm: the loss falls and the training set is
classified as labelled."""
from __future__ import annotations

import torch

from swarm import AutoDistributedModelForSequenceClassification

TEXTS = [("I loved this film, it was wonderful and moving", 1), ("What a great day, everything went perfectly", 1),
         ("This was awful, I hated every single minute", 0), ("The food was terrible and the service was rude", 0)]


def test_classification_head_and_prompts_train_through_the_swarm(swarms, model_path, tokenizer):
    swarm = swarms.get(("0:15", "15:30"))
    torch.manual_seed(0)
    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        model_path, num_labels=2, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"],
        pad_head_rows=False, tuning_mode="ptune", pre_seq_len=2)
    try:
        ids = torch.tensor([tokenizer(t)["input_ids"][:7] for t, _ in TEXTS])  # [4, 7]: no padding needed
        labels = torch.tensor([label for _, label in TEXTS])
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert {id(p) for p in trainable} == {id(model.score.weight), id(model.base.ptune.prompts)}
        optimizer = torch.optim.Adam(trainable, lr=0.01)
        losses = []
        for _ in range(10):
            optimizer.zero_grad()
            out = model(ids, labels=labels)
            out.loss.backward()
            assert model.base.ptune.prompts.grad.abs().sum() > 0  # the loss reached the prompts through the swarm
            optimizer.step()
            losses.append(out.loss.item())
        assert losses[-1] < 0.5 * losses[0], losses
        with torch.no_grad():
            predicted = model(ids).logits.argmax(-1)
        assert predicted.tolist() == labels.tolist()
    finally:
        model.shutdown()
