"""Language models: GGUF read/write, quant formats, tokenizer, chat templates, LoRA, SFT data, export."""
