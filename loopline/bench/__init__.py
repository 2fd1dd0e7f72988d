"""``loopline bench``: offline throughput/latency harness, HF baseline and HTTP client.

* :mod:`~loopline.bench.workload` -- random prompts, synthetic exit-depth traces, ShareGPT-like lengths;
* :mod:`~loopline.bench.offline` -- one closed-loop engine run and the variants;
* :mod:`~loopline.bench.hf_baseline` -- transformers ``generate()`` on the same weights;
* :mod:`~loopline.bench.compare` -- interleaved repeats, medians, ratios;
* :mod:`~loopline.bench.metrics` -- latency percentiles and the bytes-read model (GB/s);
* :mod:`~loopline.bench.env` -- commit, hardware, GPU busy time;
* :mod:`~loopline.bench.report` / :mod:`~loopline.bench.plot` -- tables, JSON record, PNG;
* :mod:`~loopline.bench.serve` -- ``loopline bench serve`` over HTTP (rates, replay phases);
* :mod:`~loopline.bench.capacity` -- the peak-capacity search under a TTFT bound.

The CLI lives in :mod:`loopline.entrypoints.bench_cli`; docs/benchmarks/README.md
defines every metric.
"""
