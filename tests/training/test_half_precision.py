"""`--precision fp16` (issue 41, index.catalogue.half_precision): the fp16 copy of an encoder and its parity gate,
run here on ONNX Runtime's CPU provider (it executes the fp16 graphs, casting the kernels it lacks back to
fp32), and the fp16 catalogue pass of `tonearm export --pretrained` and `tonearm index` end to end.

Small random-weight models keep it cheap: a ``ClapModel`` (0.37 M parameters; its graph computes the
log-mel) and a PE-Audio (0.5 M; codec + rotary transformer). The small PE-Audio's audio encoder maps the
probe signals to nearly one vector (plain cosine fp16 vs fp32 ≥ 0.99999), so what tells them apart is at
fp16's rounding level: its real fp16 copy is what the gate must stop (centred cosine ~0.2–0.7).

Cost: ~15 s on two cores (two model folders and their ONNX exports ~6 s, one export --pretrained of six clips
and two index passes ~5 s, a trained export ~1 s besides the session's shared tiny run).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import soundfile as sf

from index.bundle import format as fmt
from index.catalogue.half_precision import (
    MIN_CENTRED_COSINE,
    HalfPrecisionParityError,
    centred_cosines,
    half_precision_copy,
    parity_gate,
    probe_waves,
)
from index.catalogue.own_audio import index_folder
from index.runtime.loader import AUDIO_INPUTS, PADDING_MASK, TEXT_INPUTS, LoadedBundle, OnnxEncoder
from tests.small_pe_audio import save_small_pe_audio
from tests.training.test_pretrained_quantize import write_small_clap
from training.bundle.pretrained import (
    export_pretrained_bundle,
    export_pretrained_encoders,
    load_pretrained,
)

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 ONNX encoders of the small CLAP and PE-Audio (model folders under ``clap`` / ``pe``)."""
    base = tmp_path_factory.mktemp("half")
    found = {}
    for name, make in (("clap", write_small_clap), ("pe", save_small_pe_audio)):
        folder = make(base / name)
        out = base / f"staged-{name}"
        out.mkdir()
        export_pretrained_encoders(load_pretrained(folder), out)
        found[name], found[f"{name}_dir"] = out, folder
    return found


def run(path: Path, inputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> np.ndarray:
    return OnnxEncoder.load(path, inputs=inputs, embed_dim=32, providers=CPU, threads=1).run(feeds)


def test_centred_cosine_is_step0s() -> None:
    import torch

    from training.bundle.step0 import centred_cosines as torch_centred

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 8)), rng.standard_normal((6, 8))
    np.testing.assert_allclose(centred_cosines(a, b), torch_centred(torch.from_numpy(a), torch.from_numpy(b)).numpy(),
                               atol=1e-12)


def test_fp16_copy_keeps_the_mel_front_end_fp32_and_agrees(staged: dict[str, Path], tmp_path: Path) -> None:
    """CLAP's graph computes its log-mel: the copy keeps that chain in fp32 end to end (its 1e-10 mel floor
    would be 0 in fp16 and the log −inf) while its matmul weights are fp16; both towers pass the gate."""
    src = staged["clap"] / fmt.AUDIO_ENCODER
    half = half_precision_copy(src, tmp_path / "audio.fp16.onnx")
    model = onnx.load(str(half))
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [onnx.TensorProto.FLOAT]
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    producers = {out: node for node in model.graph.node for out in node.output}
    (log,) = [node for node in model.graph.node if node.op_type == "Log"]
    chain, node = [], log
    while node.op_type != "Conv":  # Log <- Clip <- MatMul(mel) <- Add <- squares <- Slice <- Conv(STFT)
        node = next(producers[name] for name in node.input if name in producers
                    and producers[name].op_type not in ("Constant",))
        chain.append(node.op_type)
        assert node.op_type != "Cast", f"a cast inside the fp32 mel chain: {chain}"
    waves = np.stack(probe_waves(48_000, 96_000))
    fp32, fp16 = run(src, AUDIO_INPUTS, {"waveform": waves}), run(half, AUDIO_INPUTS, {"waveform": waves})
    assert np.isfinite(fp16).all()
    assert parity_gate("audio", fp32, fp16) >= MIN_CENTRED_COSINE

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 600, (6, 20))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    text = staged["clap"] / fmt.TEXT_ENCODER
    assert parity_gate("text", run(text, TEXT_INPUTS, feeds),
                       run(half_precision_copy(text, tmp_path / "text.fp16.onnx"), TEXT_INPUTS, feeds)) >= 0.999


def test_the_gate_stops_a_copy_that_disagrees(staged: dict[str, Path], tmp_path: Path) -> None:
    src = staged["pe"] / fmt.AUDIO_ENCODER
    waves = np.stack(probe_waves(48_000, 48_000))
    feeds = {"waveform": waves, PADDING_MASK: np.ones(waves.shape, np.int64)}  # PE-Audio's graph takes a mask
    fp32 = run(src, AUDIO_INPUTS, feeds)
    fp16 = run(half_precision_copy(src, tmp_path / "pe.fp16.onnx"), AUDIO_INPUTS, feeds)
    plain = np.sum(fp32 * fp16, 1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(fp16, axis=1)
    assert plain.min() > 0.9999  # a plain cosine would let it through
    with pytest.raises(HalfPrecisionParityError) as caught:
        parity_gate("audio", fp32, fp16)
    message = str(caught.value)
    assert "\n" not in message and "min centred cosine" in message and "rerun with --precision fp32" in message


def test_fp16_pass_of_export_and_index_keeps_fp32_encoders_and_records_it(
    staged: dict[str, Path], real_manifest: Path, tmp_path: Path
) -> None:
    path = export_pretrained_bundle(staged["clap_dir"], manifest=real_manifest, out_dir=tmp_path / "bundles",
                                    progress=False, providers=CPU, precision="fp16")
    manifest = fmt.read_manifest(path)
    record = manifest.catalogue_pass
    assert record is not None and record.precision == "fp16" and record.device == "cpu"
    assert set(record.parity_min_centred_cosine) == {"audio", "text"}
    assert min(record.parity_min_centred_cosine.values()) >= MIN_CENTRED_COSINE and record.probe_items["audio"] >= 4
    for name in (fmt.AUDIO_ENCODER, fmt.TEXT_ENCODER):  # the served encoders stay fp32
        assert not any(t.data_type == onnx.TensorProto.FLOAT16 for t in onnx.load(str(path / name)).graph.initializer)
    bundle = LoadedBundle.open(path)
    try:
        rate = bundle.sample_rate
        waves = probe_waves(rate, 3 * rate)
        audio = tmp_path / "audio"
        audio.mkdir()
        for i, wave in enumerate(waves):
            sf.write(audio / f"clip-{i}.wav", wave, rate, subtype="FLOAT")
        served = bundle.encode_audio([sf.read(audio / f"clip-{i}.wav", dtype="float32")[0] for i in range(len(waves))])
    finally:
        bundle.close()
    half = index_folder(audio, path, tmp_path / "half", providers=CPU, precision="fp16")
    indexed = LoadedBundle.open(half.path)
    try:
        assert indexed.manifest.catalogue_pass is not None and set(indexed.manifest.catalogue_pass.probe_items) == {"audio"}
        assert centred_cosines(served, indexed.audio_embeddings()).min() >= MIN_CENTRED_COSINE
    finally:
        indexed.close()
    again = index_folder(audio, half.path, tmp_path / "fp32", providers=CPU)  # from the fp16-embedded bundle
    assert fmt.read_manifest(again.path).catalogue_pass is None  # this pass's record, not its source's
    assert "catalogue_pass" not in (again.path / fmt.MANIFEST_NAME).read_text()  # fp32: the manifest as before


def test_fp16_pass_of_a_trained_export(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    """`tonearm export CHECKPOINT --precision fp16`: the same record from the trained pipeline."""
    from training.bundle.export import export_bundle

    path = export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=tmp_path, progress=False, precision="fp16")
    record = fmt.read_manifest(path).catalogue_pass
    assert record is not None and set(record.probe_items) == {"audio", "text"}
    assert min(record.parity_min_centred_cosine.values()) >= MIN_CENTRED_COSINE


def test_a_cast_the_converter_added_twice_is_kept_once_and_the_copy_loads(tmp_path: Path) -> None:
    """onnxruntime-gpu 1.31.1's converter (on the H200) cast PE-Audio's fp16 Snake ``alpha`` once per fp32
    node reading it: two nodes of one name and output, a model onnxruntime refuses to load. The graph here is
    what it wrote for ``y = x * alpha + 1 / alpha`` with Mul and Reciprocal kept fp32."""
    from onnx import TensorProto, helper, numpy_helper

    from index.catalogue.half_precision import drop_duplicate_casts

    alpha = numpy_helper.from_array(np.array([2.0, 4.0], dtype=np.float16), "alpha")

    def cast() -> onnx.NodeProto:
        return helper.make_node("Cast", ["alpha"], ["alpha_cast_to_fp32"], to=TensorProto.FLOAT,
                                name="alpha_cast_to_fp32_node")

    nodes = [cast(), helper.make_node("Mul", ["x", "alpha_cast_to_fp32"], ["m"], name="mul"),
             cast(), helper.make_node("Reciprocal", ["alpha_cast_to_fp32"], ["r"], name="reciprocal"),
             helper.make_node("Add", ["m", "r"], ["y"], name="add")]
    value = helper.make_tensor_value_info("alpha_cast_to_fp32", TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [alpha],
                              value_info=[value, value])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    with pytest.raises(Exception, match="same node name"):
        ort.InferenceSession(str(broken), providers=CPU)
    assert drop_duplicate_casts(model) == 1
    assert drop_duplicate_casts(model) == 0
    fixed = tmp_path / "fixed.onnx"
    onnx.save(model, str(fixed))
    (y,) = ort.InferenceSession(str(fixed), providers=CPU).run(None, {"x": np.array([1.0, 3.0], dtype=np.float32)})
    np.testing.assert_allclose(y, [2.5, 12.25])
