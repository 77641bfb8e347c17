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
        (prompt,) = self.build_many([text])
        if isinstance(prompt, OverlongDocument):
            raise prompt
        return prompt

    def build_many(self, texts: list[str]) -> list[Prompt | OverlongDocument]:
        """Each document's prompt, or the OverlongDocument refusing it. Tokenized in two calls
        for all of them (the documents, then the rendered prompts): one call per document
        costs a shard of a hundred short rows more than its own bookkeeping."""
        if not texts:
            return []
        docs = self.tokenizer(list(texts), add_special_tokens=False).input_ids
        results: list = [None] * len(texts)
        contents = []
        for i, (text, doc_ids) in enumerate(zip(texts, docs)):
            truncated = len(doc_ids) > self.task.max_input_tokens
            if truncated and self.task.overlong == "reject":
                results[i] = OverlongDocument(
                    f"document has {len(doc_ids)} tokens, more than task.max_input_tokens="
                    f"{self.task.max_input_tokens}"
                )
                continue
            if truncated:
                text = self.tokenizer.decode(doc_ids[: self.task.max_input_tokens])
            contents.append((i, self.task.format_prompt(text), len(doc_ids), truncated))
        if self.use_chat:
            rendered = [self._render(content) for _, content, _, _ in contents]
            ids = self.tokenizer(rendered, add_special_tokens=False).input_ids if rendered else []
        else:
            ids = self.tokenizer([c for _, c, _, _ in contents]).input_ids if contents else []
        for (i, _, doc_tokens, truncated), prompt_ids in zip(contents, ids):
            results[i] = Prompt(ids=list(prompt_ids), document_tokens=doc_tokens, truncated=truncated)
        return results

    def _render(self, content: str) -> str:
        """The chat template around one prompt, as text (tokenized with the others after)."""
        messages = [{"role": "user", "content": content}]
        if self.task.system_prompt:
            messages.insert(0, {"role": "system", "content": self.task.system_prompt})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
