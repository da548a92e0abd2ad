//! Tests of hf.rs.

use super::*;
use crate::checkpoint::testutil::{tiny, TestDir};
use crate::model::gpt2_hf::LAYOUT;
use crate::model::table::gpt2_params;
use std::path::PathBuf;

/// GPT-2's key prefix and file shapes, which these tests spell out.
const KEY_PREFIX: &str = LAYOUT.key_prefix;

fn file_shape(spec: &TensorSpec, vocab: usize) -> Vec<usize> {
    LAYOUT.file_shape(spec, vocab)
}

type TensorList = Vec<(String, Vec<usize>)>;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
    format!("{:#}", r.unwrap_err())
}

#[test]
fn save_load_round_trip_and_identical_resave() {
    let d = TestDir::new("hf-round-trip");
    let (cfg, table, params) = tiny();
    let a = d.0.join("a");
    save_model(&a, &cfg, &table, &params).unwrap();
    let m = load_hf(&a).unwrap();
    assert_eq!(m.config, cfg);
    assert_eq!(m.key_prefix(), KEY_PREFIX);
    assert_eq!(m.dtype("h.1.mlp.c_fc.weight"), Some(Dtype::F32));
    assert_eq!(
        m.metadata().unwrap().get("format").map(String::as_str),
        Some("pt")
    );
    let mut back = vec![f32::NAN; table.total()];
    m.copy_into(&table, &mut back).unwrap();
    for s in table.specs() {
        assert_eq!(back[s.range()], params[s.range()], "{}", s.name);
    }
    let wte = table.get("wte.weight").unwrap();
    assert!(back[wte.offset + 101 * 32..wte.offset + 128 * 32]
        .iter()
        .all(|&x| x == 0.0));
    let b = d.0.join("b");
    m.save(&b, &table, &back).unwrap();
    for f in [MODEL_FILE, CONFIG_FILE] {
        assert_eq!(
            fs::read(a.join(f)).unwrap(),
            fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
    // wte is stored unpadded, lm_head is not stored, config.json is a GPT2Config.
    let h = st::read_header(&a.join(MODEL_FILE)).unwrap();
    assert_eq!(
        h.find("transformer.wte.weight").unwrap().shape,
        vec![101, 32]
    );
    assert!(h.entries.iter().all(|e| !e.key.contains("lm_head")));
    assert_eq!(h.entries.len(), table.specs().len());
    let v: Value = serde_json::from_slice(&fs::read(a.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(v["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(v["n_inner"], Value::Null);
    assert_eq!(v["tie_word_embeddings"], true);
    assert_eq!(v["eos_token_id"], 100);
}

#[test]
fn hf_fixture_loads_and_saves_byte_identically() {
    let (cfg, table, _) = tiny();
    let d = TestDir::new("hf-fixture");
    let mut reference = None;
    for (name, prefix, dtype, ignored) in [
        ("hf-tiny", KEY_PREFIX, Dtype::F32, 0),
        ("hf-tiny-bf16", KEY_PREFIX, Dtype::Bf16, 0),
        ("hf-tiny-hub-f16", "", Dtype::F16, 4),
    ] {
        let dir = fixture(name);
        let m = load_hf(&dir).unwrap();
        assert_eq!(m.config, cfg, "{name}");
        assert_eq!(m.key_prefix(), prefix, "{name}");
        assert_eq!(m.dtype("wte.weight"), Some(dtype), "{name}");
        assert_eq!(m.ignored_tensors().len(), ignored, "{name}");
        let mut p = vec![f32::NAN; table.total()];
        m.copy_into(&table, &mut p).unwrap();
        let wte = table.get("wte.weight").unwrap();
        assert!(p[wte.offset + 101 * 32..wte.offset + 128 * 32]
            .iter()
            .all(|&x| x == 0.0));
        // LayerNorm weights are initialised to one, biases to zero.
        let ln = table.get("h.1.ln_2.weight").unwrap();
        assert!(p[ln.range()].iter().all(|&x| x == 1.0), "{name}");
        let out = d.0.join(name);
        m.save(&out, &table, &p).unwrap();
        for f in [MODEL_FILE, CONFIG_FILE] {
            assert_eq!(
                fs::read(dir.join(f)).unwrap(),
                fs::read(out.join(f)).unwrap(),
                "{name}/{f} differs after load + save"
            );
        }
        // The low-precision variants hold the F32 fixture's weights rounded.
        match &reference {
            None => reference = Some(p),
            Some(r) => {
                let tol = if dtype == Dtype::F16 { 1e-3 } else { 8e-3 };
                for s in table.specs() {
                    for (a, b) in p[s.range()].iter().zip(&r[s.range()]) {
                        assert!(
                            (a - b).abs() <= tol * b.abs().max(0.01),
                            "{name} {}",
                            s.name
                        );
                    }
                }
            }
        }
    }
    // fugu's own writer produces exactly what save_pretrained wrote.
    let out = d.0.join("fugu");
    save_model(&out, &cfg, &table, reference.as_ref().unwrap()).unwrap();
    assert_eq!(
        fs::read(fixture("hf-tiny").join(MODEL_FILE)).unwrap(),
        fs::read(out.join(MODEL_FILE)).unwrap(),
        "save_model differs from transformers' save_pretrained"
    );
    if let Some(dst) = std::env::var_os("FUGU_HF_EXPORT") {
        // For dev/make_hf_fixture.py --verify: a directory written by save_model.
        save_model(Path::new(&dst), &cfg, &table, reference.as_ref().unwrap()).unwrap();
    }
}

#[test]
fn changed_config_and_layout() {
    let d = TestDir::new("hf-changed");
    let (cfg, table, params) = tiny();
    let m = load_hf(&fixture("hf-tiny-hub-f16")).unwrap();
    // Same layout, different weights: same header, F16 kept.
    let out = d.0.join("w");
    let mut p = params.clone();
    m.save(&out, &table, &p).unwrap();
    let m2 = load_hf(&out).unwrap();
    assert_eq!(m2.dtype("h.0.attn.c_attn.weight"), Some(Dtype::F16));
    assert_eq!(m2.ignored_tensors().len(), 4);
    m2.copy_into(&table, &mut p).unwrap();
    let s = table.get("h.0.attn.c_attn.weight").unwrap();
    assert!((p[s.offset + 5] - params[s.offset + 5]).abs() < 1e-4);
    // A bigger vocabulary: laid out afresh, prefix and dtypes kept, buffers dropped.
    let mut m3 = m.clone();
    m3.config.vocab_size = 200;
    let cfg3 = ModelConfig {
        vocab_size: 200,
        ..cfg
    };
    let t3 = gpt2_params(&cfg3, 1).unwrap();
    let p3 = vec![0.5f32; t3.total()];
    let out = d.0.join("v");
    m3.save(&out, &t3, &p3).unwrap();
    let m4 = load_hf(&out).unwrap();
    assert_eq!(m4.config, cfg3);
    assert_eq!(m4.key_prefix(), "");
    assert_eq!(m4.dtype("wte.weight"), Some(Dtype::F16));
    assert!(m4.ignored_tensors().is_empty());
    let mut back = vec![0f32; t3.total()];
    m4.copy_into(&t3, &mut back).unwrap();
    assert_eq!(back[t3.get("wte.weight").unwrap().offset + 199 * 32], 0.5);
}

#[test]
fn tied_lm_head_is_checked_and_kept() {
    let d = TestDir::new("hf-tied");
    let (cfg, table, params) = tiny();
    let wte = table.get("wte.weight").unwrap();
    let n = 101 * 32;
    let write = |dir: &Path, head: &[f32]| {
        fs::create_dir_all(dir).unwrap();
        let mut t: Vec<OutTensor> = table
            .specs()
            .iter()
            .map(|s| {
                let shape = file_shape(s, 101);
                let k = shape.iter().product::<usize>();
                OutTensor {
                    key: s.name.clone(),
                    dtype: Dtype::F32,
                    shape,
                    data: Data::F32(&params[s.offset..s.offset + k]),
                }
            })
            .collect();
        t.push(OutTensor {
            key: "lm_head.weight".into(),
            dtype: Dtype::F32,
            shape: vec![101, 32],
            data: Data::F32(head),
        });
        let h = st::build_header(None, &t);
        let mut f = File::create(dir.join(MODEL_FILE)).unwrap();
        st::write_body(&mut f, &h, &t).unwrap();
        fs::write(dir.join(CONFIG_FILE), json_text(&hf_config_json(&cfg))).unwrap();
    };
    let same = d.0.join("same");
    write(&same, &params[wte.offset..wte.offset + n]);
    let m = load_hf(&same).unwrap();
    assert_eq!(m.ignored_tensors(), vec!["lm_head.weight"]);
    let mut p = vec![0f32; table.total()];
    m.copy_into(&table, &mut p).unwrap();
    let out = d.0.join("out");
    m.save(&out, &table, &p).unwrap();
    assert_eq!(
        fs::read(same.join(MODEL_FILE)).unwrap(),
        fs::read(out.join(MODEL_FILE)).unwrap()
    );
    let differs = d.0.join("differs");
    write(&differs, &vec![0.25; n]);
    let e = err(load_hf(&differs).unwrap().copy_into(&table, &mut p));
    assert!(
        e.contains("`lm_head.weight` differs from `wte.weight`"),
        "{e}"
    );
}

/// Writes the tiny model with `edit` applied to the tensor list.
fn write_edited(dir: &Path, edit: impl FnOnce(&mut TensorList)) {
    let (cfg, table, _) = tiny();
    let mut list: TensorList = table
        .specs()
        .iter()
        .map(|s| (format!("{KEY_PREFIX}{}", s.name), file_shape(s, 101)))
        .collect();
    edit(&mut list);
    let data: Vec<Vec<f32>> = list
        .iter()
        .map(|(_, s)| vec![0.1; s.iter().product()])
        .collect();
    let t: Vec<OutTensor> = list
        .iter()
        .zip(&data)
        .map(|((k, s), x)| OutTensor {
            key: k.clone(),
            dtype: Dtype::F32,
            shape: s.clone(),
            data: Data::F32(x),
        })
        .collect();
    fs::create_dir_all(dir).unwrap();
    let h = st::build_header(Some(&pt_metadata()), &t);
    let mut f = File::create(dir.join(MODEL_FILE)).unwrap();
    st::write_body(&mut f, &h, &t).unwrap();
    fs::write(dir.join(CONFIG_FILE), json_text(&hf_config_json(&cfg))).unwrap();
}

#[test]
fn missing_unknown_and_misshapen_tensors_are_named() {
    let d = TestDir::new("hf-errors");
    let (_, table, _) = tiny();
    let mut p = vec![0f32; table.total()];
    let load = |name: &str, edit: &dyn Fn(&mut TensorList)| {
        let dir = d.0.join(name);
        write_edited(&dir, edit);
        let r = load_hf(&dir).and_then(|m| m.copy_into(&table, &mut p.clone()));
        err(r)
    };
    let e = load("missing", &|l| {
        l.retain(|(k, _)| k != "transformer.h.1.mlp.c_fc.bias")
    });
    assert!(
        e.contains("missing: `h.1.mlp.c_fc.bias`") && e.contains(MODEL_FILE),
        "{e}"
    );
    let e = load("shape", &|l| l[4].1 = vec![32, 64]);
    let k = &l_key(4);
    assert!(
        e.contains(&format!("`{k}` has shape [32, 64], expected [32, 96]")),
        "{e}"
    );
    let e = load("vocab", &|l| l[0].1 = vec![100, 32]);
    assert!(
        e.contains("`transformer.wte.weight` has shape [100, 32], expected [101, 32]"),
        "{e}"
    );
    let e = load("unknown", &|l| {
        l.push(("transformer.h.2.ln_1.weight".into(), vec![32]));
        l.push(("score.weight".into(), vec![2, 32]));
    });
    assert!(
        e.contains("2 tensor(s) that fugu's GPT-2 model does not have")
            && e.contains("`transformer.h.2.ln_1.weight`")
            && e.contains("`score.weight`"),
        "{e}"
    );
    let e = load("dup", &|l| l.push(("wte.weight".into(), vec![101, 32])));
    assert!(e.contains("`wte.weight` is stored twice"), "{e}");
    // The right model loads, into a table of another model it does not.
    write_edited(&d.0.join("ok"), |_| {});
    load_hf(&d.0.join("ok"))
        .unwrap()
        .copy_into(&table, &mut p)
        .unwrap();
    let other = gpt2_params(
        &ModelConfig {
            vocab_size: 300,
            n_positions: 16,
            n_embd: 32,
            n_head: 4,
            n_layer: 2,
            ..Default::default()
        },
        1,
    )
    .unwrap();
    let e = err(load_hf(&d.0.join("ok"))
        .unwrap()
        .copy_into(&other, &mut vec![0f32; other.total()]));
    assert!(e.contains("vocab_size 101 pads to 128 rows"), "{e}");
}

fn l_key(i: usize) -> String {
    let (_, table, _) = tiny();
    format!("{KEY_PREFIX}{}", table.specs()[i].name)
}

#[test]
fn corrupt_and_truncated_files_fail_cleanly() {
    let d = TestDir::new("hf-corrupt");
    let good = d.0.join("good");
    let (cfg, table, params) = tiny();
    save_model(&good, &cfg, &table, &params).unwrap();
    let bytes = fs::read(good.join(MODEL_FILE)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut badjson = bytes.clone();
    badjson[8 + n / 2] = b'}';
    let mut badoff = bytes.clone();
    let h = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let h2 = h.replacen("\"data_offsets\":[0,", "\"data_offsets\":[4,", 1);
    badoff[8..8 + n].copy_from_slice(h2.as_bytes());
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "shorter than the 8-byte header length"),
        ("short", bytes[..6].to_vec(), "shorter than the 8-byte"),
        ("header", bytes[..8 + n / 2].to_vec(), "header length"),
        (
            "data",
            bytes[..bytes.len() - 10].to_vec(),
            "truncated safetensors file",
        ),
        ("long", [&bytes[..], &[0u8; 4]].concat(), "the file holds"),
        ("huge", huge, "header length"),
        ("json", badjson, "corrupt safetensors header"),
        ("offsets", badoff, "data_offsets"),
    ];
    let mut p = vec![0f32; table.total()];
    for (name, b, want) in cases {
        let dir = d.0.join(name);
        fs::create_dir_all(&dir).unwrap();
        fs::copy(good.join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
        fs::write(dir.join(MODEL_FILE), b).unwrap();
        let e = err(load_hf(&dir).and_then(|m| m.copy_into(&table, &mut p)));
        assert!(e.contains(want) && e.contains(MODEL_FILE), "{name}: {e}");
    }
    // Truncated after load_hf checked the size: the read fails, no panic.
    let dir = d.0.join("late");
    save_model(&dir, &cfg, &table, &params).unwrap();
    let m = load_hf(&dir).unwrap();
    fs::write(dir.join(MODEL_FILE), &bytes[..bytes.len() / 2]).unwrap();
    let e = err(m.copy_into(&table, &mut p));
    assert!(e.contains("file truncated?"), "{e}");
    let e = err(load_hf(&d.0.join("nothing-here")));
    assert!(e.contains(CONFIG_FILE), "{e}");
}

#[test]
fn config_json_round_trip_and_rejections() {
    let (cfg, _, _) = tiny();
    let p = Path::new("x/config.json");
    let text = json_text(&hf_config_json(&cfg));
    assert_eq!(parse_hf_config(&text, p).unwrap(), cfg);
    // Fields transformers defaults may be missing; gelu_pytorch_tanh is the same GELU.
    let c = parse_hf_config(
        r#"{"model_type":"gpt2","activation_function":"gelu_pytorch_tanh","n_inner":3072}"#,
        p,
    )
    .unwrap();
    assert_eq!((c.vocab_size, c.n_embd, c.n_layer), (50257, 768, 12));
    let bad = |k: &str, v: Value, want: &str| {
        let mut j = hf_config_json(&cfg);
        j[k] = v;
        let e = err(parse_hf_config(&j.to_string(), p));
        assert!(
            e.contains("x/config.json") && e.contains(&format!("`{k}`")) && e.contains(want),
            "{k}: {e}"
        );
    };
    bad("activation_function", json!("relu"), "not supported");
    bad("n_inner", json!(100), "4 * n_embd = 128");
    bad(
        "scale_attn_by_inverse_layer_idx",
        json!(true),
        "not supported",
    );
    bad("reorder_and_upcast_attn", json!(true), "not supported");
    bad("tie_word_embeddings", json!(false), "not supported");
    bad("scale_attn_weights", json!(false), "not supported");
    bad("add_cross_attention", json!(true), "not supported");
    bad("layer_norm_epsilon", json!(1e-6), "only 1e-5");
    bad("model_type", json!("mistral"), "only \"gpt2\" or \"llama\"");
    bad("n_embd", json!("32"), "positive integer");
    bad("n_layer", json!(0), "positive integer");
    bad("n_head", json!(5), "not divisible");
    bad("tie_word_embeddings", json!("yes"), "true or false");
    let e = err(parse_hf_config("[1]", p));
    assert!(e.contains("JSON object"), "{e}");
    let e = err(parse_hf_config("{", p));
    assert!(e.contains("invalid JSON"), "{e}");
}

#[test]
fn save_model_rejects_a_sharded_table() {
    let (cfg, _, _) = tiny();
    let t2 = gpt2_params(&cfg, 2).unwrap();
    let d = TestDir::new("hf-tp");
    let e = err(save_model(&d.0, &cfg, &t2, &vec![0f32; t2.total()]));
    assert!(e.contains("not the full GPT-2 table"), "{e}");
    let (_, t, _) = tiny();
    let e = err(save_model(&d.0, &cfg, &t, &[0f32; 10]));
    assert!(e.contains("parameter buffer holds 10 floats"), "{e}");
}

/// Splits `dir/model.safetensors` into two shards plus `model.safetensors.index.json`, the
/// way `save_pretrained(max_shard_size=...)` stores larger models; `edit` may change the index.
fn shard(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let h = st::read_header(&dir.join(MODEL_FILE)).unwrap();
    let mut f = File::open(dir.join(MODEL_FILE)).unwrap();
    let half = h.entries.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&h.entries[..half], &h.entries[half..]].iter().enumerate() {
        let name = format!("model-0000{}-of-00002.safetensors", i + 1);
        let data: Vec<Vec<f32>> = part
            .iter()
            .map(|e| {
                let mut x = vec![0f32; e.numel()];
                st::read_f32(&mut f, &h, e, &mut x).unwrap();
                x
            })
            .collect();
        let t: Vec<OutTensor> = part
            .iter()
            .zip(&data)
            .map(|(e, x)| OutTensor {
                key: e.key.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                data: Data::F32(x),
            })
            .collect();
        let hdr = st::build_header(Some(&pt_metadata()), &t);
        let mut out = File::create(dir.join(&name)).unwrap();
        st::write_body(&mut out, &hdr, &t).unwrap();
        for e in part.iter() {
            map.insert(e.key.clone(), Value::String(name.clone()));
        }
    }
    fs::remove_file(dir.join(MODEL_FILE)).unwrap();
    let mut index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    edit(&mut index);
    fs::write(dir.join(INDEX_FILE), json_text(&index)).unwrap();
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let d = TestDir::new("hf-sharded");
    let (cfg, table, params) = tiny();
    let a = d.0.join("a");
    save_model(&a, &cfg, &table, &params).unwrap();
    shard(&a, |_| {});
    let m = load_hf(&a).unwrap();
    assert_eq!((m.shard_count(), m.config.clone()), (2, cfg.clone()));
    let mut back = vec![f32::NAN; table.total()];
    m.copy_into(&table, &mut back).unwrap();
    for s in table.specs() {
        let n = file_shape(s, cfg.vocab_size).iter().product::<usize>();
        assert_eq!(
            back[s.offset..s.offset + n],
            params[s.offset..s.offset + n],
            "{}",
            s.name
        );
    }
    // Saved back as one file, with the same weights.
    let b = d.0.join("b");
    m.save(&b, &table, &back).unwrap();
    let mut again = vec![f32::NAN; table.total()];
    load_hf(&b).unwrap().copy_into(&table, &mut again).unwrap();
    assert_eq!(again, back);

    // An index that disagrees with its shards is named.
    const KEY: &str = "transformer.h.0.ln_1.weight";
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: [(&str, Edit, &str); 4] = [
        (
            "unlisted",
            Box::new(|v| {
                v["weight_map"].as_object_mut().unwrap().remove(KEY);
            }),
            "does not list",
        ),
        (
            "elsewhere",
            Box::new(|v| {
                let f = v["weight_map"][KEY]
                    .as_str()
                    .unwrap()
                    .replace("00001-of", "00002-of");
                let f = if f == v["weight_map"][KEY].as_str().unwrap() {
                    f.replace("00002-of", "00001-of")
                } else {
                    f
                };
                v["weight_map"][KEY] = Value::String(f);
            }),
            "places in",
        ),
        (
            "escape",
            Box::new(|v| {
                v["weight_map"][KEY] = Value::String("../x.safetensors".into());
            }),
            "expected a file in the same folder",
        ),
        (
            "no-map",
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("weight_map");
            }),
            "no `weight_map`",
        ),
    ];
    for (name, edit, want) in cases {
        let dir = d.0.join(name);
        save_model(&dir, &cfg, &table, &params).unwrap();
        shard(&dir, edit);
        let e = err(load_hf(&dir));
        assert!(e.contains(want), "{name}: {e}");
    }
    // No weights at all.
    let empty = d.0.join("empty");
    fs::create_dir_all(&empty).unwrap();
    fs::write(empty.join(CONFIG_FILE), json_text(&hf_config_json(&cfg))).unwrap();
    let e = err(load_hf(&empty));
    assert!(e.contains("no model.safetensors"), "{e}");
}
