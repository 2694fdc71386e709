"""The built-in inference engine: a step-wise core with continuous batching over a paged KV cache.

Read in this order: ``request.py`` (what a request is), ``blocks.py`` (the block allocator and
prefix cache), ``scheduler.py`` (who runs each step), ``runner.py`` (the model over the paged
cache, CUDA graphs), ``attention.py`` / ``triton_decode.py`` (attention over pages),
``sampler.py`` (vectorised sampling), ``core.py`` (the loop that ties them together); on CPU,
``cpu_decode.py`` (the decode window), ``cpu_layers.py`` (the layers through the C kernels, decode and prefill)
and ``cpu_native.c`` / ``cpu_native.py`` (those kernels).
"""
