"""Step-time benchmarks: lnstrain against a Hugging Face baseline, LNS against Pre-LN.

``tools/benchmark.py`` is the command; this package holds its pieces: peak matrix rates
(``peak``), timing and paired statistics (``timing``), the throughput and MFU arithmetic
(``throughput``), the step runners (``runners``, ``hf_baseline``) and the JSON report (``report``).
"""

from lnstrain.benchmark.peak import PEAK_BF16_TFLOPS, detect_peak_tflops
from lnstrain.benchmark.throughput import Throughput, throughput
from lnstrain.benchmark.timing import PairedRatio, TimingSummary, paired_ratio, summarize

__all__ = ["PEAK_BF16_TFLOPS", "PairedRatio", "Throughput", "TimingSummary", "detect_peak_tflops",
           "paired_ratio", "summarize", "throughput"]
