"""Where the documents of a packed row begin: the convention of prepared datasets.

Prepared shards separate documents with the end-of-document token, which therefore begins
every document after the first (it is what the document's first token is predicted from,
as :func:`~k3_trainer.data.document_start` puts it in front of a prompt). A model that
keeps documents apart (``document_ids``, :mod:`k3_model.documents`) gets ids that count
those tokens along each row.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def document_ids(tokens: Tensor, boundary: int) -> Tensor:
    """``(B, T)`` ids, equal within a document, of a packed ``(B, T)`` row whose documents
    are separated by the ``boundary`` token (which begins the next document)."""
    return (tokens == boundary).long().cumsum(dim=1)


def document_boundary(loader: Any) -> int:
    """The end-of-document id of the data ``loader`` reads (its manifest's tokenizer)."""
    return int(loader.tokenizer["eod_id"])
