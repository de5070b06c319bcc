"""Quantized weights kept quantized: llama.cpp's GGUF block formats and int8, decoded at load into one
block form (:mod:`~cadence.quantization.blocks`), packed for the CPU kernel
(:mod:`~cadence.quantization.packed`, ``backends/csrc/quant_linear.cpp``). ``docs/quantization.md``
has the formats, their bits per weight and the measured error."""
