"""Documents to prompt token ids: task template, chat template, and the length policy."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec import TaskSpec


@dataclass
class Prompt:
    ids: list[int]
    document_tokens: int  # tokens of the document before any truncation
    truncated: bool


class OverlongDocument(ValueError):
    """The document exceeds task.max_input_tokens and the spec says to reject it."""


class PromptBuilder:
    """Builds the token ids the model sees for one document.

    Truncation applies to the document, before the instruction and chat template are wrapped
    around it, so an overlong document never loses the instruction that tells the model what
    to do with it.
    """

    def __init__(self, tokenizer, task: TaskSpec):
        self.tokenizer = tokenizer
        self.task = task
        self.use_chat = task.chat_template and bool(getattr(tokenizer, "chat_template", None))

    def build(self, text: str) -> Prompt:
        doc_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        truncated = len(doc_ids) > self.task.max_input_tokens
        if truncated:
            if self.task.overlong == "reject":
                raise OverlongDocument(
                    f"document has {len(doc_ids)} tokens, more than task.max_input_tokens="
                    f"{self.task.max_input_tokens}"
                )
            text = self.tokenizer.decode(doc_ids[: self.task.max_input_tokens])
        content = self.task.format_prompt(text)
        if self.use_chat:
            messages = [{"role": "user", "content": content}]
            if self.task.system_prompt:
                messages.insert(0, {"role": "system", "content": self.task.system_prompt})
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(content).input_ids
        return Prompt(ids=list(ids), document_tokens=len(doc_ids), truncated=truncated)
