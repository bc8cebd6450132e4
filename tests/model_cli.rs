//! `kiln logits`, `kiln generate`, `kiln chat`, `kiln convert` and `kiln init-model`: the tools a user checks
//! a port or a checkpoint with, run as a user would. Also the committed result of reloading kiln's exports in
//! transformers (tests/fixtures/lfm2/export_check.json, written by the fixture script).

mod common;

use common::{project_dir, run_kiln, run_kiln_with_input};
use safetensors::SafeTensors;
use serde_json::Value;

fn f32s(view: &safetensors::tensor::TensorView) -> Vec<f32> {
    view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn logits_cli_writes_the_forward_pass() {
    let fixture_dir = project_dir().join("tests/fixtures/lfm2/lfm2-tiny");
    let bytes = std::fs::read(fixture_dir.join("fixture.safetensors")).unwrap();
    let fixture = SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<i64> = fixture
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = f32s(&fixture.tensor("logits").unwrap());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("logits.safetensors");
    let id_list: Vec<String> = ids[..12].iter().map(|i| i.to_string()).collect();
    let (ok, _, stderr) = run_kiln(
        &[
            "logits",
            "--model-dir",
            fixture_dir.to_str().unwrap(),
            "--ids",
            &id_list.join(","),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    let got_bytes = std::fs::read(&out).unwrap();
    let got = SafeTensors::deserialize(&got_bytes).unwrap();
    let logits = got.tensor("logits").unwrap();
    assert_eq!(logits.shape(), [12, 256]);
    let err = f32s(&logits).iter().zip(&want[..12 * 256]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err <= 1e-4, "{err}");

    let (ok, _, stderr) = run_kiln(
        &["logits", "--model-dir", fixture_dir.to_str().unwrap(), "--ids", "999", "--out", out.to_str().unwrap()],
        &[],
        &project_dir(),
    );
    assert!(!ok && stderr.contains("outside the vocabulary"), "{stderr}");
    let (ok, _, stderr) = run_kiln(
        &["logits", "--model-dir", "/nonexistent", "--ids", "1", "--out", out.to_str().unwrap()],
        &[],
        &project_dir(),
    );
    assert!(!ok && stderr.contains("/nonexistent/config.json"), "{stderr}");
}

#[test]
fn init_model_generate_and_convert_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    for out in [&a, &b] {
        let (ok, _, stderr) = run_kiln(
            &["init-model", "--from", "configs/models/tiny", "--out", out.to_str().unwrap(), "--seed", "3"],
            &[],
            &project_dir(),
        );
        assert!(ok, "{stderr}");
    }
    assert_eq!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap(),
        "seeded init is deterministic"
    );
    assert!(a.join("tokenizer.json").is_file() && a.join("chat_template.jinja").is_file());

    let (ok, stdout, stderr) = run_kiln(
        &["generate", "--model-dir", a.to_str().unwrap(), "--prompt", "ls", "--chat", "--max-tokens", "5"],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    assert!(stderr.contains("generate:") && stderr.contains("tokens in"), "{stderr}");
    let (ok, again, _) = run_kiln(
        &["generate", "--model-dir", a.to_str().unwrap(), "--prompt", "ls", "--chat", "--max-tokens", "5"],
        &[],
        &project_dir(),
    );
    assert!(ok);
    assert_eq!(stdout, again, "greedy decoding is deterministic");
    let (ok, _, stderr) =
        run_kiln(&["generate", "--model-dir", a.to_str().unwrap(), "--prompt", ""], &[], &project_dir());
    assert!(!ok && stderr.contains("the prompt is empty"), "{stderr}");
    let model = a.to_str().unwrap();
    let generate = |max_tokens: &str| {
        run_kiln(&["generate", "--model-dir", model, "--prompt", "ls", "--max-tokens", max_tokens], &[], &project_dir())
    };
    let (ok, _, stderr) = generate("0");
    assert!(!ok && stderr.contains("--max-tokens is 0"), "{stderr}");
    let (ok, _, stderr) = generate("100000000");
    assert!(!ok && stderr.contains("exceeds the context length") && stderr.contains("new tokens)"), "{stderr}");

    let c = dir.path().join("c");
    let (ok, _, stderr) = run_kiln(
        &["convert", "--model-dir", a.to_str().unwrap(), "--out", c.to_str().unwrap(), "--dtype", "bf16"],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    let bytes = std::fs::read(c.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("model.embed_tokens.weight").unwrap().dtype(), safetensors::Dtype::BF16);
    let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(metadata.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));

    // A bf16 checkpoint loaded and exported again (dtype follows the source) is byte-identical.
    let d = dir.path().join("d");
    let (ok, _, stderr) =
        run_kiln(&["convert", "--model-dir", c.to_str().unwrap(), "--out", d.to_str().unwrap()], &[], &project_dir());
    assert!(ok, "{stderr}");
    assert_eq!(std::fs::read(d.join("model.safetensors")).unwrap(), bytes);

    // Converting a checkpoint into its own folder is refused, and every file of it stays as it was.
    let before: Vec<Vec<u8>> = ["model.safetensors", "config.json", "tokenizer.json"]
        .iter()
        .map(|f| std::fs::read(d.join(f)).unwrap())
        .collect();
    let (ok, _, stderr) =
        run_kiln(&["convert", "--model-dir", d.to_str().unwrap(), "--out", d.to_str().unwrap()], &[], &project_dir());
    assert!(!ok && stderr.contains("is the checkpoint being read"), "{stderr}");
    for (f, bytes) in ["model.safetensors", "config.json", "tokenizer.json"].iter().zip(before) {
        assert_eq!(std::fs::read(d.join(f)).unwrap(), bytes, "{f} changed");
    }
}

#[test]
fn kiln_exports_reload_in_transformers_to_the_same_logits() {
    let path = project_dir().join("tests/fixtures/lfm2/export_check.json");
    let check: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let results = check["results"].as_object().unwrap();
    for key in ["lfm2-tiny/f32", "lfm2-tiny/bf16", "lfm2-moe-tiny/f32", "lfm2-moe-tiny/bf16"] {
        let err = results[key]["max_abs_logits_error"].as_f64().unwrap();
        assert!(err <= 1e-5, "{key}: transformers reloaded kiln's export {err} away from the reference");
    }
}

#[test]
fn info_reports_the_backends_and_the_switches() {
    let cwd = project_dir();
    let (ok, stdout, stderr) = run_kiln(&["info"], &[], &cwd);
    assert!(ok, "{stderr}");
    let info: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(info["cpu_smoke_test"], "ok");
    assert!(info["backends"].as_array().unwrap().iter().any(|b| b.as_str().unwrap().starts_with("flex")));
    assert_eq!(info["cuda_fusion"], "on");
    // Which kernels a CUDA build's first steps compile: burn's autotune only with the `autotune` feature.
    assert_eq!(info["cuda_autotune"], if cfg!(feature = "autotune") { "on" } else { "off" });
    if !cfg!(feature = "cuda") {
        assert_eq!(info["cuda_smoke_test"], "not built");
    }
    // The CPU's matmul width, and the malloc thresholds the CPU backend's allocations want (glibc), unless
    // the environment sets malloc's own.
    assert!(["avx512", "avx2", "baseline"].contains(&info["cpu_matmul_simd"].as_str().unwrap()), "{info}");
    assert!(info["host_memory_gib"].as_f64().is_some_and(|gib| gib > 0.5), "{info}");
    let tuned = "glibc malloc: mmap threshold 32 MiB, trim threshold 256 MiB";
    if cfg!(all(target_os = "linux", target_env = "gnu")) && std::env::var_os("GLIBC_TUNABLES").is_none() {
        assert_eq!(info["host_allocator"], tuned);
    }
    let (ok, stdout, _) = run_kiln(&["info"], &[("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")], &cwd);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap()["host_allocator"], "the platform's defaults");

    let (ok, stdout, _) = run_kiln(&["info"], &[("KILN_CUDA_FUSION", "off")], &cwd);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap()["cuda_fusion"], "off");
    let (ok, stdout, _) = run_kiln(&["info"], &[("KILN_CUDA_FUSION", "sideways")], &cwd);
    assert!(ok);
    let fusion = serde_json::from_str::<Value>(&stdout).unwrap()["cuda_fusion"].as_str().unwrap().to_string();
    assert!(
        fusion.contains("KILN_CUDA_FUSION=\"sideways\"") && fusion.contains("use on or off (unset: on)"),
        "{fusion}"
    );

    // The DeltaNet scan kernel's switch: reported by info (unset: each runtime's default), and a malformed
    // value stops other commands.
    assert_eq!(info["scan_kernel"], "unset: off on cuda, on on vulkan");
    let (ok, stdout, _) = run_kiln(&["info"], &[("KILN_SCAN_KERNEL", "off")], &cwd);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap()["scan_kernel"], "off");
    let (ok, _, stderr) = run_kiln(&["synth", "--out", "/nonexistent/x"], &[("KILN_SCAN_KERNEL", "no")], &cwd);
    assert!(!ok && stderr.contains("KILN_SCAN_KERNEL=\"no\": use on or off (unset: the device's default"), "{stderr}");

    // The attention's chunk budget: info reports it in MiB, and a malformed value stops other commands.
    assert_eq!(info["attention_chunk_mib"], 256);
    let (ok, stdout, _) = run_kiln(&["info"], &[("KILN_ATTENTION_CHUNK_MIB", "1024")], &cwd);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap()["attention_chunk_mib"], 1024);
    let (ok, _, stderr) = run_kiln(&["synth", "--out", "/nonexistent/x"], &[("KILN_ATTENTION_CHUNK_MIB", "1g")], &cwd);
    assert!(!ok && stderr.contains("KILN_ATTENTION_CHUNK_MIB=\"1g\": use a whole number of MiB"), "{stderr}");
}

/// The tiny config's random-init checkpoint of seed 3 in `dir/m`.
fn random_tiny_checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let model = dir.join("m");
    let (ok, _, stderr) = run_kiln(
        &["init-model", "--from", "configs/models/tiny", "--out", model.to_str().unwrap(), "--seed", "3"],
        &[],
        &project_dir(),
    );
    assert!(ok, "{stderr}");
    model
}

/// Sampling follows the flags over the checkpoint's generation_config.json and repeats with its seed; a chat
/// keeps its conversation: each reply is what `kiln generate` continues from the conversation rendered so far,
/// and the transcript holds each conversation after what the file held.
#[test]
fn generate_samples_as_configured_and_chat_keeps_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let model = random_tiny_checkpoint(dir.path());
    let m = model.to_str().unwrap();
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--model-dir", m, "--max-tokens", "12"];
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = run_kiln(&args, &[], &project_dir());
        assert!(ok, "{extra:?}: {stderr}");
        (stdout, stderr)
    };
    let (greedy, stderr) = generate(&["--prompt", "ls", "--chat"]);
    assert!(stderr.contains("generate: ") && stderr.trim_end().ends_with(", greedy"), "{stderr}");
    let sample =
        |seed: &str| generate(&["--prompt", "ls", "--chat", "--temperature", "1", "--top-k", "0", "--seed", seed]);
    let (five, stderr) = sample("5");
    assert!(stderr.contains("sampling (temperature 1), --seed 5"), "{stderr}");
    assert_eq!(sample("5").0, five, "a seed repeats its draws");
    assert_ne!(sample("6").0, five, "another seed draws other tokens");
    assert_ne!(five, greedy);

    // The checkpoint's own settings apply unless the flags say otherwise.
    let config = model.join("generation_config.json");
    std::fs::write(&config, r#"{"do_sample": true, "temperature": 0.7, "top_p": 0.9, "eos_token_id": 7}"#).unwrap();
    let (_, stderr) = generate(&["--prompt", "ls", "--chat", "--seed", "1"]);
    assert!(stderr.contains("sampling (temperature 0.7, top-k 50, top-p 0.9), --seed 1"), "{stderr}");
    assert_eq!(generate(&["--prompt", "ls", "--chat", "--greedy"]).0, greedy);
    assert_eq!(generate(&["--prompt", "ls", "--chat", "--temperature", "0"]).0, greedy);
    std::fs::write(&config, r#"{"do_sample": true, "top_p": 2}"#).unwrap();
    let (ok, _, stderr) = run_kiln(&["generate", "--model-dir", m, "--prompt", "ls"], &[], &project_dir());
    assert!(!ok && stderr.contains("generation_config.json: top_p = 2: must lie in [0, 1]"), "{stderr}");
    let (ok, _, stderr) =
        run_kiln(&["generate", "--model-dir", m, "--prompt", "ls", "--greedy", "--top-p", "0.5"], &[], &project_dir());
    assert!(!ok && stderr.contains("cannot be used with"), "{stderr}");
    std::fs::remove_file(&config).unwrap();

    let transcript = dir.path().join("chats.jsonl");
    let earlier = r#"{"id":"earlier","messages":[{"role":"user","content":"hi"}]}"#;
    std::fs::write(&transcript, earlier).unwrap();
    let chat_args =
        ["chat", "--model-dir", m, "--greedy", "--max-tokens", "12", "--transcript", transcript.to_str().unwrap()];
    let (ok, stdout, stderr) = run_kiln_with_input(&chat_args, "ls\n/reset\nls\n\npwd \\\n-P\n", &project_dir());
    assert!(ok, "{stderr}");
    assert!(stderr.contains("(a new conversation)") && stderr.matches(" tokens in ").count() == 3, "{stderr}");
    // A turn runs only what the conversation's kept states do not hold: nothing is kept for the first turn
    // of a conversation; the next continues from the last at least where the earlier conversation ends.
    let continued: Vec<usize> =
        stderr.lines().filter_map(|l| l.split_once("; ")?.1.split_once(" of the prompt's ")?.0.parse().ok()).collect();
    assert!(continued.len() == 3 && continued[..2] == [0, 0] && continued[2] > 0, "{stderr}");
    let (ok, rerun, stderr) = run_kiln_with_input(
        &[&chat_args[..6], &["--no-kept-states"]].concat(),
        "ls\n/reset\nls\n\npwd \\\n-P\n",
        &project_dir(),
    );
    assert!(ok && stderr.matches("; 0 of the prompt's").count() == 3, "{stderr}");
    assert_eq!(rerun, stdout, "the whole prompts decode the same replies");
    let lines: Vec<Value> =
        std::fs::read_to_string(&transcript).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0]["id"], "earlier");
    let roles =
        |line: &Value| line["messages"].as_array().unwrap().iter().map(|m| m["role"].clone()).collect::<Vec<_>>();
    assert_eq!(roles(&lines[1]), ["user", "assistant"]);
    assert_eq!(roles(&lines[2]), ["user", "assistant", "user", "assistant"]);
    assert_eq!(lines[2]["messages"][2]["content"], "pwd \n-P");
    // The third reply continues the second conversation as the template renders it.
    let template = kiln::chat::ChatTemplate::load(&model, None, kiln::chat::PinnedClock::now()).unwrap();
    let history = &lines[2]["messages"].as_array().unwrap()[..3];
    let prompt = template.render(history, None, true, &serde_json::Map::new()).unwrap().text;
    let (third, _) = generate(&["--prompt", &prompt]);
    assert_eq!(stdout, format!("{greedy}{greedy}{third}"));
    assert_eq!(lines[2]["messages"][3]["content"].as_str().unwrap(), third.strip_suffix('\n').unwrap());

    // A turn past the context is refused and the chat goes on.
    let (ok, stdout, stderr) = run_kiln_with_input(
        &["chat", "--model-dir", m, "--max-tokens", "100000000"],
        "ls\n/exit\nls\n",
        &project_dir(),
    );
    assert!(ok && stdout.is_empty(), "{stderr}");
    assert!(stderr.contains("error: this turn would pass the context length"), "{stderr}");
}

/// `kiln chat --tools`: the schemas are offered every turn and kept in the transcript, `/tool` answers a call
/// as a tool message, and a tools file that is not a list of schemas is refused before the model loads.
#[test]
fn chat_offers_tools_and_takes_their_results() {
    let dir = tempfile::tempdir().unwrap();
    let model = random_tiny_checkpoint(dir.path());
    let m = model.to_str().unwrap();
    let tools = dir.path().join("tools.json");
    let bash = serde_json::json!({"name": "bash", "description": "Runs a command", "parameters": {"type": "object"}});
    std::fs::write(&tools, serde_json::json!([bash]).to_string()).unwrap();
    let transcript = dir.path().join("chat.jsonl");
    let (t, tr) = (tools.to_str().unwrap(), transcript.to_str().unwrap());
    let args = ["chat", "--model-dir", m, "--greedy", "--max-tokens", "6", "--tools", t, "--transcript", tr];
    let (ok, _, stderr) = run_kiln_with_input(&args, "list files\n/tool a.txt\\\nb.txt\n", &project_dir());
    assert!(ok && stderr.matches(" tokens in ").count() == 2, "{stderr}");
    let line: Value = serde_json::from_str(std::fs::read_to_string(&transcript).unwrap().trim()).unwrap();
    assert_eq!(line["tools"], serde_json::json!([{"type": "function", "function": bash}]));
    let messages = line["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(messages[2]["content"], "a.txt\nb.txt");
    // The second reply continues the prompt the template renders with the tools and the result.
    let template = kiln::chat::ChatTemplate::load(&model, None, kiln::chat::PinnedClock::now()).unwrap();
    let prompt = template.render(&messages[..3], Some(&line["tools"]), true, &serde_json::Map::new()).unwrap().text;
    assert!(prompt.contains("<|tool_list_start|>") && prompt.contains("<|tool_response_start|>a.txt\nb.txt"));
    let (ok, reply, stderr) =
        run_kiln(&["generate", "--model-dir", m, "--max-tokens", "6", "--prompt", &prompt], &[], &project_dir());
    assert!(ok, "{stderr}");
    assert_eq!(messages[3]["content"].as_str().unwrap(), reply.strip_suffix('\n').unwrap());

    for (text, why) in
        [("{\"name\": \"bash\"}", "not a list of function schemas"), ("[", "not JSON"), ("[]", "no tools")]
    {
        std::fs::write(&tools, text).unwrap();
        // Refused before any input is read (run_kiln gives it none).
        let (ok, _, stderr) = run_kiln(&args, &[], &project_dir());
        assert!(!ok && stderr.contains(t) && stderr.contains(why), "{text}: {stderr}");
    }
}

/// Ctrl-C during a reply ends that reply, keeps what was shown in the conversation, and the chat goes on; at
/// the prompt it ends the chat (exit status 130). It ends `kiln generate`'s stream with a summary (130).
#[test]
fn ctrl_c_stops_a_reply_and_at_the_prompt_ends_the_chat() {
    use std::io::{BufRead, Read, Write};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    // This seed's random model does not stop on its own within thousands of tokens.
    let model = random_tiny_checkpoint(dir.path());
    let transcript = dir.path().join("chat.jsonl");
    let chat = || {
        Command::new(common::kiln_bin())
            .args(["chat", "--model-dir", model.to_str().unwrap(), "--greedy", "--max-tokens", "8000"])
            .args(["--transcript", transcript.to_str().unwrap()])
            .current_dir(project_dir())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let interrupt = |child: &std::process::Child| assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);

    let mut child = chat();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"ls\n").unwrap();
    // The reply has begun once its first text arrives.
    let mut first = [0u8; 1];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    interrupt(&child);
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let tokens: usize = stderr.split('[').nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    assert!(stderr.contains("stopped by Ctrl-C;") && tokens < 8000, "{stderr}");
    let line = std::fs::read_to_string(&transcript).unwrap();
    let conversation: Value = serde_json::from_str(line.trim_end()).unwrap();
    let shown = String::from_utf8([&first[..], &out.stdout].concat()).unwrap();
    let reply = conversation["messages"][1]["content"].as_str().unwrap();
    assert_eq!(shown.strip_suffix('\n'), Some(reply), "the conversation keeps what was shown");

    let mut child = chat();
    // Held open until the chat has ended: `wait` would close it, and the end of input ends a chat too.
    let _stdin = child.stdin.take();
    let mut banner = String::new();
    std::io::BufReader::new(child.stderr.as_mut().unwrap()).read_line(&mut banner).unwrap();
    assert!(banner.starts_with("kiln chat: "), "{banner}");
    interrupt(&child);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");

    // `kiln generate` stops its stream too, sums up what it generated and exits 130.
    let mut child = Command::new(common::kiln_bin())
        .args(["generate", "--model-dir", model.to_str().unwrap(), "--prompt", "ls", "--max-tokens", "8000"])
        .current_dir(project_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    interrupt(&child);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let tokens: usize = stderr.split("generate: ").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    assert!(stderr.contains("(stopped by Ctrl-C)") && (1..8000).contains(&tokens), "{stderr}");
}
