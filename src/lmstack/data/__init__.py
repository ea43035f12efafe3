"""Pretraining data engineering: a raw web crawl in, clean deduplicated token shards out.

A pipeline is a list of small steps over :class:`~lmstack.data.document.Document` streams (readers ->
extractors -> filters -> dedup -> tokenizer -> writers), each keeping stats and a reason for every
document it drops (docs/data.md).
"""
