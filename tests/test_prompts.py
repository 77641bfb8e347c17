"""Prompts built for a whole shard at once (`PromptBuilder.build_many`) are the token ids that
building them one by one, with the chat template tokenizing each, gives."""

from __future__ import annotations

import pytest
from decode_case import TEXTS

from pipeline.job.prompts import OverlongDocument, PromptBuilder
from pipeline.spec.schema import TaskSpec


def _alone(tokenizer, task: TaskSpec, text: str) -> tuple[list[int], bool]:
    doc = tokenizer(text, add_special_tokens=False).input_ids
    truncated = len(doc) > task.max_input_tokens
    if truncated:
        text = tokenizer.decode(doc[: task.max_input_tokens])
    content = task.format_prompt(text)
    if task.chat_template and tokenizer.chat_template:
        messages = [{"role": "user", "content": content}]
        if task.system_prompt:
            messages.insert(0, {"role": "system", "content": task.system_prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(content).input_ids
    return list(ids), truncated


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_shards_prompts_at_once_are_each_prompt_alone(tiny_models, chat, system):
    tokenizer = tiny_models[2]
    task = TaskSpec(kind="summarize", chat_template=chat, system_prompt=system, max_input_tokens=12)
    texts = [*TEXTS, "", "ü " * 40]
    built = PromptBuilder(tokenizer, task).build_many(texts)
    assert [(p.ids, p.truncated) for p in built] == [_alone(tokenizer, task, t) for t in texts]
    assert any(p.truncated for p in built) and not all(p.truncated for p in built)


def test_overlong_documents_are_refused_one_by_one(tiny_models):
    tokenizer = tiny_models[2]
    task = TaskSpec(kind="summarize", max_input_tokens=6, overlong="reject")
    built = PromptBuilder(tokenizer, task).build_many(["fox", TEXTS[1], "Data"])
    assert isinstance(built[1], OverlongDocument) and "max_input_tokens=6" in str(built[1])
    assert [p.ids for p in (built[0], built[2])] == [_alone(tokenizer, task, t)[0] for t in ("fox", "Data")]
    assert PromptBuilder(tokenizer, task).build_many([]) == []
    with pytest.raises(OverlongDocument):
        PromptBuilder(tokenizer, task).build(TEXTS[1])
