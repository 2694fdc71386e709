"""`miles serve`'s request and response fields against SGLang's own schemas (sglang 0.5.23).

SGLang cannot be installed with its dependencies on a CPU machine, so the test imports it from a folder
built by ``tests/serve/sglang_schema_env.sh`` (sglang without its dependencies, a few light packages, a
torchvision stand-in): ``MILES_SGLANG_PATH``, or else one the test builds once (about 25 s, from the
package index) under ``~/.cache/miles``; it skips only where that build cannot reach the index.
A subprocess imports SGLang from there (it patches transformers' torchvision check, so that
transformers does not import the stand-in's missing vision code) and prints the field names of
``GenerateReqInput``, ``SamplingParams`` and the other endpoints' requests, the routes of its HTTP
server and the ``meta_info`` keys its tokenizer manager writes; the test checks every name Miles
reads or writes against them.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.serve.protocol import _SAMPLING_KEYS

SGLANG = "0.5.23"  # the version sglang_schema_env.sh installs

PROBE = r"""
import dataclasses, json, re
from pathlib import Path
import transformers.utils as u, transformers.utils.import_utils as iu
iu.is_torchvision_available = u.is_torchvision_available = lambda: False
import sglang, sglang.srt.managers.io_struct as io
from sglang.srt.sampling.sampling_params import SamplingParams

def names(cls):
    return sorted(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else sorted(cls.__struct_fields__)

srt = Path(sglang.__file__).parent / "srt"
http = (srt / "entrypoints" / "http_server.py").read_text()
tm = (srt / "managers" / "tokenizer_manager.py").read_text()
print(json.dumps({
    "version": sglang.__version__,
    "generate": names(io.GenerateReqInput),
    "sampling": names(SamplingParams),
    "requests": {n: names(getattr(io, n)) for n in ("AbortReq", "PauseGenerationReqInput", "UpdateWeightFromDiskReqInput",
                 "UpdateWeightsFromTensorReqInput", "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput",
                 "InitWeightsUpdateGroupReqInput", "UpdateWeightsFromDistributedReqInput")},
    "routes": sorted(set(re.findall(r'@app\.(?:get|post|put|api_route)\(\s*"(/[^"]*)"', http)) | set(re.findall(r'^\s*"(/[a-z_/]+)",\s*$', http, re.M))),
    "tokenizer_manager": tm,
}))
"""


def _schema_folder() -> Path:
    """MILES_SGLANG_PATH, or the cached folder, built (into a temporary folder, then renamed) if it is not there."""
    if os.environ.get("MILES_SGLANG_PATH"):
        return Path(os.environ["MILES_SGLANG_PATH"])
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles" / f"sglang-schema-{SGLANG}"
    if not folder.is_dir():
        tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))  # pip of this python
        out = subprocess.run(["bash", str(Path(__file__).with_name("sglang_schema_env.sh")), str(tmp)], env=env,
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.skip(f"could not build SGLang's schema folder (no package index here?): {out.stderr.strip()[-300:]}")
        os.replace(tmp, folder)
    return folder


@pytest.fixture(scope="module")
def sglang_names():
    site = _schema_folder()
    paths = os.pathsep.join([str(site / "site"), str(site / "stub")])
    env = dict(os.environ, PYTHONPATH=paths + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == SGLANG
    return got


def test_generate_request_fields(sglang_names):
    # the /generate fields protocol.parse_generate reads
    assert {"text", "input_ids", "sampling_params", "rid", "return_logprob", "top_logprobs_num", "stream"} <= set(sglang_names["generate"])
    # every sampling key Miles accepts is SGLang's, except "seed" (an alias of sampling_seed, OpenAI's name)
    assert _SAMPLING_KEYS - {"seed"} <= set(sglang_names["sampling"]), _SAMPLING_KEYS - set(sglang_names["sampling"])


def test_other_endpoints_request_fields(sglang_names):
    req = sglang_names["requests"]
    read = {  # the body fields miles_core/serve/server.py reads, per SGLang request type
        "AbortReq": {"rid", "abort_all"},
        "PauseGenerationReqInput": {"mode"},
        "UpdateWeightFromDiskReqInput": {"model_path", "weight_version"},
        "ReleaseMemoryOccupationReqInput": {"tags"},
        "ResumeMemoryOccupationReqInput": {"tags"},
        "InitWeightsUpdateGroupReqInput": {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
        "UpdateWeightsFromDistributedReqInput": {"names", "dtypes", "shapes", "group_name", "weight_version"},
        "UpdateWeightsFromTensorReqInput": {"weight_version"},  # its tensors: `named_tensors`, a documented departure
    }
    for name, fields in read.items():
        assert fields <= set(req[name]), (name, fields - set(req[name]))


def test_routes_and_meta_info(sglang_names):
    import re

    import miles_core.serve.server as server

    ours = set(re.findall(r'^\s*"(/[^"]*)": Handler\.', Path(server.__file__).read_text(), re.M))  # the ROUTES table
    assert len(ours) > 15
    extra = {"/get_weight_version"}  # Miles' own (SGLang 0.5.23 reports the version in /model_info only)
    assert ours - extra <= set(sglang_names["routes"]), ours - extra - set(sglang_names["routes"])
    tm = sglang_names["tokenizer_manager"]
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs", "output_top_logprobs",
                "finish_reason", "weight_version", "routed_experts"):
        assert f'"{key}"' in tm, key
