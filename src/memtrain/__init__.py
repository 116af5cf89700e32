"""memtrain: train Transformer language models under memory limits, and measure what each
memory technique buys."""

__version__ = "0.2.0"
