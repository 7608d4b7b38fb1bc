#!/usr/bin/env python
"""Train a sentencepiece tokenizer (BPE or unigram) on a raw corpus.

    python tools/train_tokenizer.py --input corpus/*.jsonl.gz --vocab-size 32000 --model-type bpe \\
        --output-prefix tok/spm

Reads .jsonl/.json/.txt, optionally .gz/.zst, .parquet and datasets save_to_disk directories (these
two need `pip install pyarrow`), streaming; keeps a uniform random sample of at most
--max-sentences lines (reservoir sampling, so memory is bounded whatever the corpus size); writes
<output-prefix>.model and <output-prefix>.vocab.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.data.corpus_readers import TXT_MODES, expand_inputs  # noqa: E402
from lnstrain.data.tokenizer import Tokenizer  # noqa: E402
from lnstrain.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="input files, glob patterns, or datasets save_to_disk directories")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="the JSON key(s), or Parquet/Arrow column(s), holding the text (the same option as "
                        "tools/preprocess_data.py's; the texts of several keys are all sampled)")
    p.add_argument("--txt-mode", choices=TXT_MODES, default="line", help="what a document is in .txt files")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="size of the uniform sentence sample")
    p.add_argument("--max-sentence-chars", type=int, default=4192, help="longer lines are cut")
    p.add_argument("--max-read-mb", type=float, default=0.0, help="stop reading after this many MB (0: read all)")
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                   help="disable byte fallback (unknown characters then map to <unk>)")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--normalization", choices=["identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"],
                   default="identity", help="text normalization; identity (as LLaMA) keeps newlines and spacing")
    p.add_argument("--unk-id", type=int, default=0)
    p.add_argument("--bos-id", type=int, default=1, help="-1 for none")
    p.add_argument("--eos-id", type=int, default=2, help="-1 for none")
    p.add_argument("--pad-id", type=int, default=-1, help="-1 for none")
    p.add_argument("--user-defined-symbols", nargs="*", default=[], help="extra special tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the sentence sample")
    p.add_argument("--threads", type=int, default=0, help="training threads (0: all cores)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        paths = expand_inputs(args.input)
        cfg = TokenizerTrainingConfig(
            inputs=paths, output_prefix=args.output_prefix, vocab_size=args.vocab_size,
            model_type=args.model_type, json_keys=args.json_keys, txt_mode=args.txt_mode,
            max_sentences=args.max_sentences, max_sentence_chars=args.max_sentence_chars,
            max_read_mb=args.max_read_mb, byte_fallback=args.byte_fallback,
            character_coverage=args.character_coverage,
            normalization=args.normalization, unk_id=args.unk_id, bos_id=args.bos_id,
            eos_id=args.eos_id, pad_id=args.pad_id, user_defined_symbols=args.user_defined_symbols,
            seed=args.seed, num_threads=args.threads)
        print(f"train_tokenizer: {len(paths)} input file(s), {args.model_type} vocab {args.vocab_size}", flush=True)
        report = train_tokenizer(cfg, paths)
    except (ValueError, ImportError, FileNotFoundError) as e:  # the input or the options
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # reading or writing failed
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 1
    tok = Tokenizer(report.model_path)
    print(f"read {report.documents_read} documents ({report.mb_read:.1f} MB), {report.sentences_seen} sentences; "
          f"sampled {report.sentences_sampled} in {report.sample_seconds:.1f}s")
    print(f"skipped: {report.skips.report()}")
    print(f"trained {args.model_type} in {report.train_seconds:.1f}s: vocab {tok.vocab_size}, unk={tok.unk_id} "
          f"bos={tok.bos_id} eos={tok.eos_id} pad={tok.pad_id}, byte_fallback={args.byte_fallback}")
    print(f"wrote {report.model_path} and {report.vocab_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
