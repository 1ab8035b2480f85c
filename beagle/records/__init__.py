"""Records, read one way by every command: the input formats (`files`: JSON arrays through ijson, JSONL,
Parquet, `datasets` directories), what a record says (`messages`: one role map, one parser for chats,
prompts and texts) and why one is rejected (`reasons`: one `RejectReason` enum, one size bound).

`extract`, `regenerate` and `eval` all read through here, so each accepts what the others accept; the
jobs stream records with `pipeline.jobkit.record_stream` on top of `iter_raw_records`.
"""
from beagle.records.files import check_data_path, iter_raw_records, record_turns, text_bytes
from beagle.records.messages import ROLE_NAMES, TEXT_ROLE, ParsedRecord, parse_record, text_value
from beagle.records.reasons import (DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_TURNS, MAX_JSON_DEPTH, RejectReason,
                                    RejectRecord)

__all__ = ["DEFAULT_MAX_RECORD_BYTES", "DEFAULT_MAX_TURNS", "MAX_JSON_DEPTH", "ROLE_NAMES", "TEXT_ROLE",
           "ParsedRecord", "RejectReason", "RejectRecord", "check_data_path", "iter_raw_records",
           "parse_record", "record_turns", "text_bytes", "text_value"]
