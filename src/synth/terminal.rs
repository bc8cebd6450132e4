//! Synthetic Terminus-2 terminal trajectories: a few dozen task families whose right commands follow from
//! the task text (paths, names, patterns) and from the terminal output (counts, names), so that a small
//! model can learn them and be measured on held-out tasks.

use rand::Rng;
use rand::seq::IndexedRandom;
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use crate::data::{Conversation, Message, Role};

pub const PROMPT: &str = "root@sandbox:/app#";

/// The instruction block that opens every synthetic task prompt (kiln's own wording of the Terminus-2 contract).
pub const INSTRUCTIONS: &str = "You are an AI assistant that solves command-line tasks in a Linux shell. You are given a task and the terminal output of the commands run so far, and you reply with the next batch of shell commands.

Reply with JSON of this shape:

{
  \"analysis\": \"What the terminal shows, what is done and what is left.\",
  \"plan\": \"The next steps and what each command should achieve.\",
  \"commands\": [
    {
      \"keystrokes\": \"ls -la\\n\",
      \"duration\": 0.1
    }
  ],
  \"task_complete\": false
}

The keystrokes are sent to the terminal verbatim: end each command with a newline. Set \"task_complete\" to true once the task is done.";

/// One assistant turn and what the terminal printed for each of its commands.
#[derive(Debug, Clone)]
pub struct Step {
    pub think: String,
    pub analysis: String,
    pub plan: String,
    pub commands: Vec<String>,
    pub outputs: Vec<String>,
    pub complete: bool,
}

#[derive(Debug, Clone)]
pub struct Task {
    pub family: &'static str,
    pub group: &'static str,
    pub description: String,
    pub steps: Vec<Step>,
}

impl Step {
    fn new(think: String, analysis: String, plan: String, commands: &[(&str, &str)], complete: bool) -> Step {
        // The scorer takes the first '{' of a reply as the start of its JSON, so thinking must not hold braces.
        debug_assert!(!think.contains(['{', '}']), "braces in think text: {think}");
        Step {
            think,
            analysis,
            plan,
            commands: commands.iter().map(|(c, _)| format!("{c}\n")).collect(),
            outputs: commands.iter().map(|(_, o)| o.to_string()).collect(),
            complete,
        }
    }

    /// The assistant message: a think block, then the JSON action pretty-printed as Terminus-2 agents do.
    pub fn assistant_text(&self) -> String {
        format!("<think>\n{}\n</think>\n\n{}", self.think, pretty(&self.action()))
    }

    pub fn action(&self) -> Value {
        let commands: Vec<Value> = self.commands.iter().map(|c| json!({"keystrokes": c, "duration": 0.1})).collect();
        json!({"analysis": self.analysis, "plan": self.plan, "commands": commands, "task_complete": self.complete})
    }

    /// The next user turn: the commands echoed at the prompt with their output.
    pub fn observation(&self) -> String {
        let mut text = String::from("New Terminal Output:\n");
        for (cmd, out) in self.commands.iter().zip(&self.outputs) {
            text.push_str(PROMPT);
            text.push(' ');
            text.push_str(cmd);
            if !out.is_empty() {
                text.push_str(out);
                text.push('\n');
            }
        }
        text.push_str(PROMPT);
        text
    }
}

pub fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

impl Task {
    pub fn first_user_message(&self) -> String {
        format!(
            "{INSTRUCTIONS}\n\nTask Description:\n{}\n\nCurrent terminal state:\nCurrent Terminal Screen:\n{PROMPT}\n",
            self.description
        )
    }

    /// The trajectory as a conversation: task prompt, then assistant actions and terminal observations.
    pub fn conversation(&self, id: &str, task_name: &str) -> Conversation {
        let mut messages = vec![Message::new(Role::User, self.first_user_message())];
        for (i, step) in self.steps.iter().enumerate() {
            messages.push(Message::new(Role::Assistant, step.assistant_text()));
            if i + 1 < self.steps.len() {
                messages.push(Message::new(Role::User, step.observation()));
            }
        }
        let mut meta = serde_json::Map::new();
        meta.insert("task".into(), json!(task_name));
        meta.insert("episode".into(), json!(format!("episode-{}", self.steps.len() - 1)));
        meta.insert("trial_name".into(), json!(format!("{task_name}__{id}")));
        meta.insert("source_group".into(), json!(self.group));
        meta.insert("family".into(), json!(self.family));
        Conversation { id: id.to_string(), source: "terminal".into(), messages, tools: Vec::new(), meta }
    }
}

const DIRS: &[&str] =
    &["data", "logs", "reports", "inputs", "records", "exports", "archive", "staging", "metrics", "shared"];
const STEMS: &[&str] = &[
    "sales",
    "users",
    "events",
    "orders",
    "inventory",
    "access",
    "server",
    "notes",
    "results",
    "payments",
    "sensors",
    "tickets",
];
const PATTERNS: &[&str] = &["ERROR", "WARN", "timeout", "failed", "denied", "GET", "POST", "404", "500", "retry"];
const WORDS: &[&str] =
    &["alpha", "beta", "gamma", "delta", "staging", "production", "legacy", "v1", "v2", "draft", "final"];
const PACKAGES: &[(&str, &str)] = &[
    ("requests", "2.31.0"),
    ("numpy", "1.26.4"),
    ("pyyaml", "6.0.1"),
    ("flask", "3.0.2"),
    ("pandas", "2.2.1"),
    ("click", "8.1.7"),
];

struct Ctx<'a> {
    rng: &'a mut ChaCha8Rng,
}

impl Ctx<'_> {
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        *items.choose(self.rng).expect("pools are non-empty")
    }
    fn num(&mut self, lo: u32, hi: u32) -> u32 {
        self.rng.random_range(lo..=hi)
    }
    /// An `ls -la` listing of `files` (name, size) as the terminal would print it.
    fn listing(&mut self, files: &[(String, u32)]) -> String {
        let mut out = format!(
            "total {}\ndrwxr-xr-x 2 root root 4096 Jan  1 10:44 .\ndrwxr-xr-x 8 root root 4096 Jan  1 10:44 ..",
            files.len() * 4
        );
        for (name, size) in files {
            let day = self.num(1, 28);
            out.push_str(&format!("\n-rw-r--r-- 1 root root {size:>5} Jan {day:>2} 09:{:02} {name}", self.num(0, 59)));
        }
        out
    }
}

/// The first step of every task: look at the directory the task names.
fn explore(ctx: &mut Ctx, dir: &str, files: &[(String, u32)], goal: &str) -> Step {
    let listing = ctx.listing(files);
    Step::new(
        format!(
            "The task is about {dir}. Before changing anything I should see which files are there.\nI will list /app/{dir}."
        ),
        format!("Nothing has been run yet. The task concerns /app/{dir}; {goal}."),
        format!("List /app/{dir} to confirm the files the task mentions."),
        &[(&format!("ls -la /app/{dir}"), &listing)],
        false,
    )
}

fn others(ctx: &mut Ctx, keep: &str, ext: &str) -> Vec<(String, u32)> {
    let mut files = vec![(keep.to_string(), ctx.num(200, 90000))];
    for _ in 0..ctx.num(1, 3) {
        let name = format!("{}.{ext}", ctx.pick(STEMS));
        if !files.iter().any(|(n, _)| n == &name) {
            files.push((name, ctx.num(200, 90000)));
        }
    }
    files.sort();
    files
}

/// Counting families: run a command that prints a number, then write that number to the answer file.
fn counting(
    ctx: &mut Ctx,
    family: &'static str,
    group: &'static str,
    what: &str,
    ext: &str,
    command: impl Fn(&str) -> String,
) -> Task {
    let dir = ctx.pick(DIRS);
    let file = format!("{}.{ext}", ctx.pick(STEMS));
    let answer = format!("/app/{}.txt", ctx.pick(&["answer", "count", "result", "total"]));
    let path = format!("/app/{dir}/{file}");
    let n = ctx.num(3, 4800);
    let files = others(ctx, &file, ext);
    let cmd = command(&path);
    let steps = vec![
        explore(ctx, dir, &files, &format!("I need {what} in {file} and to save it to {answer}")),
        Step::new(
            format!("{file} is present in /app/{dir}. I need {what}.\nOne command prints exactly that number."),
            format!("The listing shows {file} in /app/{dir}. Next I compute {what}."),
            format!("Run `{cmd}` and read the number it prints."),
            &[(&cmd, &n.to_string())],
            false,
        ),
        Step::new(
            format!("The command printed {n}. I write {n} to {answer} and print the file to check it."),
            format!("The result is {n}. It still has to be written to {answer}."),
            format!("Write {n} to {answer} and display it to confirm."),
            &[(&format!("echo {n} > {answer}"), ""), (&format!("cat {answer}"), &n.to_string())],
            true,
        ),
    ];
    Task {
        family,
        group,
        description: format!("Find {what} in {path} and write that number, and nothing else, to {answer}."),
        steps,
    }
}

/// Transforming families: one command does the job, a second one verifies it.
#[allow(clippy::too_many_arguments)]
fn transforming(
    ctx: &mut Ctx,
    family: &'static str,
    group: &'static str,
    dir: &str,
    files: Vec<(String, u32)>,
    description: String,
    goal: &str,
    act: (String, String),
    check: (String, String),
) -> Task {
    let steps = vec![
        explore(ctx, dir, &files, goal),
        Step::new(
            format!("The files are where the task says. One command will {goal}; a second one checks the result."),
            format!("The listing confirms the input in /app/{dir}. The change itself has not been made yet."),
            format!("Run `{}`, then verify with `{}`.", act.0, check.0),
            &[(&act.0, &act.1), (&check.0, &check.1)],
            true,
        ),
    ];
    Task { family, group, description, steps }
}

type Family = fn(&mut Ctx) -> Task;

fn count_lines(c: &mut Ctx) -> Task {
    counting(c, "count_lines", "file_operations", "the number of lines", "txt", |p| format!("wc -l < {p}"))
}
fn count_words(c: &mut Ctx) -> Task {
    counting(c, "count_words", "file_operations", "the number of words", "txt", |p| format!("wc -w < {p}"))
}
fn count_matches(c: &mut Ctx) -> Task {
    let pat = c.pick(PATTERNS);
    let what = format!("the number of lines containing '{pat}'");
    counting(c, "count_matches", "data_processing", &what, "log", move |p| format!("grep -c '{pat}' {p}"))
}
fn count_csv_rows(c: &mut Ctx) -> Task {
    counting(c, "count_csv_rows", "data_processing", "the number of data rows (without the header)", "csv", |p| {
        format!("tail -n +2 {p} | wc -l")
    })
}
fn column_sum(c: &mut Ctx) -> Task {
    let col = c.num(2, 5);
    let what = format!("the sum of column {col}");
    counting(c, "column_sum", "data_querying", &what, "csv", move |p| {
        format!("awk -F, 'NR>1 {{s+=${col}}} END {{print s}}' {p}")
    })
}
fn unique_values(c: &mut Ctx) -> Task {
    let col = c.num(1, 4);
    let what = format!("the number of distinct values in column {col}");
    counting(c, "unique_values", "data_querying", &what, "csv", move |p| {
        format!("tail -n +2 {p} | cut -d, -f{col} | sort -u | wc -l")
    })
}
fn count_files(c: &mut Ctx) -> Task {
    let ext = c.pick(&["py", "json", "csv", "log", "md"]);
    let dir = c.pick(DIRS);
    let answer = "/app/answer.txt";
    let n = c.num(2, 40);
    let files = others(c, &format!("index.{ext}"), ext);
    let cmd = format!("find /app/{dir} -name '*.{ext}' | wc -l");
    let steps = vec![
        explore(c, dir, &files, &format!("I need to count the .{ext} files under it")),
        Step::new(
            format!(
                "The listing only shows the top level; .{ext} files may sit in subfolders, so `find` is the right tool."
            ),
            format!("/app/{dir} exists. The .{ext} files still need counting, including subfolders."),
            format!("Count the .{ext} files with `{cmd}`."),
            &[(&cmd, &n.to_string())],
            false,
        ),
        Step::new(
            format!("There are {n} .{ext} files. I write {n} to {answer}."),
            format!("find reports {n} .{ext} files. The number must go to {answer}."),
            format!("Write {n} to {answer} and show it."),
            &[(&format!("echo {n} > {answer}"), ""), (&format!("cat {answer}"), &n.to_string())],
            true,
        ),
    ];
    Task {
        family: "count_files",
        group: "file_operations",
        description: format!(
            "Count the .{ext} files under /app/{dir} (subfolders included) and write the count to {answer}."
        ),
        steps,
    }
}
fn largest_file(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let keep = format!("{}.dat", c.pick(STEMS));
    let mut files = others(c, &keep, "dat");
    files.push((format!("{}_full.dat", c.pick(STEMS)), 99000 + c.num(1, 900)));
    let biggest = files.iter().max_by_key(|(_, s)| *s).map(|(n, _)| n.clone()).unwrap_or_default();
    let answer = "/app/largest.txt";
    let steps = vec![
        explore(c, dir, &files, "I need the name of its largest file"),
        Step::new(
            format!(
                "From the sizes in the listing, {biggest} is the largest file. I confirm with `ls -S` and save the name."
            ),
            format!("The listing shows the sizes; {biggest} is the largest."),
            format!("Write the name of the largest file to {answer} using `ls -S`, then show it."),
            &[(&format!("ls -S /app/{dir} | head -n 1 > {answer}"), ""), (&format!("cat {answer}"), &biggest)],
            true,
        ),
    ];
    Task {
        family: "largest_file",
        group: "file_operations",
        description: format!("Write the name of the largest file in /app/{dir} to {answer}."),
        steps,
    }
}
fn replace_text(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.conf", c.pick(STEMS));
    let (old, new) = (c.pick(WORDS), c.pick(&["release", "stable", "current", "next", "main"]));
    let path = format!("/app/{dir}/{file}");
    let n = c.num(1, 30);
    let files = others(c, &file, "conf");
    transforming(
        c,
        "replace_text",
        "file_operations",
        dir,
        files,
        format!("In {path}, replace every occurrence of '{old}' with '{new}'."),
        &format!("replace '{old}' with '{new}' in {file}"),
        (format!("sed -i 's/{old}/{new}/g' {path}"), String::new()),
        (format!("grep -c '{new}' {path}"), n.to_string()),
    )
}
fn sort_unique(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.txt", c.pick(STEMS));
    let out = format!("/app/{dir}/{}_sorted.txt", file.trim_end_matches(".txt"));
    let n = c.num(5, 900);
    let files = others(c, &file, "txt");
    transforming(
        c,
        "sort_unique",
        "data_processing",
        dir,
        files,
        format!("Sort the lines of /app/{dir}/{file}, remove duplicates, and save the result to {out}."),
        &format!("sort {file} without duplicates into {out}"),
        (format!("sort -u /app/{dir}/{file} > {out}"), String::new()),
        (format!("wc -l {out}"), format!("{n} {out}")),
    )
}
fn head_lines(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.log", c.pick(STEMS));
    let k = c.num(3, 50);
    let out = format!("/app/{dir}/first_{k}.log");
    let files = others(c, &file, "log");
    transforming(
        c,
        "head_lines",
        "file_operations",
        dir,
        files,
        format!("Save the first {k} lines of /app/{dir}/{file} to {out}."),
        &format!("copy the first {k} lines of {file} to {out}"),
        (format!("head -n {k} /app/{dir}/{file} > {out}"), String::new()),
        (format!("wc -l {out}"), format!("{k} {out}")),
    )
}
fn tail_errors(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.log", c.pick(STEMS));
    let pat = c.pick(PATTERNS);
    let k = c.num(2, 20);
    let out = format!("/app/{dir}/last_{}.log", pat.to_lowercase());
    let files = others(c, &file, "log");
    transforming(
        c,
        "tail_errors",
        "system_administration",
        dir,
        files,
        format!("Write the last {k} lines of /app/{dir}/{file} that contain '{pat}' to {out}."),
        &format!("extract the last {k} '{pat}' lines"),
        (format!("grep '{pat}' /app/{dir}/{file} | tail -n {k} > {out}"), String::new()),
        (format!("wc -l {out}"), format!("{k} {out}")),
    )
}
fn make_archive(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let name = format!("{dir}_{}", c.pick(&["backup", "snapshot", "bundle"]));
    let keep = format!("{}.csv", c.pick(STEMS));
    let files = others(c, &keep, "csv");
    let listing: Vec<String> = files.iter().map(|(f, _)| format!("{dir}/{f}")).collect();
    transforming(
        c,
        "make_archive",
        "system_administration",
        dir,
        files,
        format!("Create a gzip-compressed tar archive /app/{name}.tar.gz of the directory /app/{dir}."),
        &format!("archive /app/{dir} into /app/{name}.tar.gz"),
        (format!("tar -czf /app/{name}.tar.gz -C /app {dir}"), String::new()),
        (format!("tar -tzf /app/{name}.tar.gz"), format!("{dir}/\n{}", listing.join("\n"))),
    )
}
fn move_by_ext(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let ext = c.pick(&["csv", "json", "log", "bak"]);
    let dest = format!("{}_{ext}", c.pick(&["sorted", "by_type", "moved"]));
    let keep = format!("{}.{ext}", c.pick(STEMS));
    let files = others(c, &keep, ext);
    let moved: Vec<String> = files.iter().map(|(f, _)| f.clone()).collect();
    transforming(
        c,
        "move_by_ext",
        "file_operations",
        dir,
        files,
        format!("Move every .{ext} file from /app/{dir} into a new directory /app/{dest}."),
        &format!("move the .{ext} files into /app/{dest}"),
        (format!("mkdir -p /app/{dest} && mv /app/{dir}/*.{ext} /app/{dest}/"), String::new()),
        (format!("ls /app/{dest}"), moved.join("\n")),
    )
}
fn set_permissions(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.sh", c.pick(&["deploy", "backup", "cleanup", "rotate", "sync"]));
    let mode = c.pick(&["755", "700", "750", "644", "600"]);
    let path = format!("/app/{dir}/{file}");
    let files = others(c, &file, "sh");
    transforming(
        c,
        "set_permissions",
        "security",
        dir,
        files,
        format!("Set the permissions of {path} to {mode}."),
        &format!("set mode {mode} on {file}"),
        (format!("chmod {mode} {path}"), String::new()),
        (format!("stat -c '%a' {path}"), mode.to_string()),
    )
}
fn checksum(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.tar", c.pick(STEMS));
    let path = format!("/app/{dir}/{file}");
    let digest: String = (0..64).map(|_| char::from(b"0123456789abcdef"[c.num(0, 15) as usize])).collect();
    let files = others(c, &file, "tar");
    transforming(
        c,
        "checksum",
        "security",
        dir,
        files,
        format!("Compute the SHA-256 checksum of {path} and write only the hex digest to /app/checksum.txt."),
        &format!("record the SHA-256 of {file}"),
        (format!("sha256sum {path} | cut -d' ' -f1 > /app/checksum.txt"), String::new()),
        ("cat /app/checksum.txt".into(), digest),
    )
}
fn top_ip(c: &mut Ctx) -> Task {
    let dir = c.pick(&["logs", "var", "nginx"]);
    let file = format!("{}.log", c.pick(&["access", "requests", "traffic"]));
    let ip = format!("10.{}.{}.{}", c.num(0, 255), c.num(0, 255), c.num(1, 254));
    let hits = c.num(20, 900);
    let path = format!("/app/{dir}/{file}");
    let files = others(c, &file, "log");
    let cmd = format!("awk '{{print $1}}' {path} | sort | uniq -c | sort -rn | head -n 1");
    let steps = vec![
        explore(c, dir, &files, "I need the IP address with the most requests"),
        Step::new(
            "The first field of each access-log line is the client IP. Counting them with sort | uniq -c gives the busiest one.".into(),
            format!("{file} is there. The busiest client is not known yet."),
            format!("Count requests per IP with `{cmd}`."),
            &[(&cmd, &format!("{hits:>7} {ip}"))],
            false,
        ),
        Step::new(
            format!("{ip} made {hits} requests, the most. I write {ip} to /app/top_ip.txt."),
            format!("The top client is {ip} with {hits} requests. It must be saved."),
            "Write the IP to /app/top_ip.txt and show it.".into(),
            &[(&format!("echo {ip} > /app/top_ip.txt"), ""), ("cat /app/top_ip.txt", &ip)],
            true,
        ),
    ];
    Task {
        family: "top_ip",
        group: "system_administration",
        description: format!("Find the IP address with the most requests in {path} and write it to /app/top_ip.txt."),
        steps,
    }
}
fn json_field(c: &mut Ctx) -> Task {
    let dir = c.pick(&["config", "settings", "inputs"]);
    let file = format!("{}.json", c.pick(&["app", "service", "database", "worker"]));
    let key = c.pick(&["port", "version", "host", "timeout", "workers"]);
    let value = match key {
        "port" => c.num(1024, 9999).to_string(),
        "version" => format!("{}.{}.{}", c.num(0, 4), c.num(0, 20), c.num(0, 9)),
        "host" => c.pick(&["localhost", "db.internal", "0.0.0.0", "cache.local"]).to_string(),
        _ => c.num(1, 120).to_string(),
    };
    let path = format!("/app/{dir}/{file}");
    let files = others(c, &file, "json");
    transforming(
        c,
        "json_field",
        "data_querying",
        dir,
        files,
        format!("Read the top-level '{key}' field of {path} and write its value to /app/{key}.txt."),
        &format!("extract '{key}' from {file}"),
        (format!("jq -r '.{key}' {path} > /app/{key}.txt"), String::new()),
        (format!("cat /app/{key}.txt"), value),
    )
}
fn env_var(c: &mut Ctx) -> Task {
    let dir = c.pick(&["service", "web", "api", "worker"]);
    let var = c.pick(&["LOG_LEVEL", "MAX_WORKERS", "API_TIMEOUT", "CACHE_SIZE", "REGION"]);
    let value = match var {
        "LOG_LEVEL" => c.pick(&["debug", "info", "warning"]).to_string(),
        "REGION" => c.pick(&["eu-west-1", "us-east-2", "ap-south-1"]).to_string(),
        _ => c.num(2, 512).to_string(),
    };
    let files = vec![(".env".to_string(), c.num(40, 400)), ("app.py".to_string(), c.num(900, 9000))];
    transforming(
        c,
        "env_var",
        "system_administration",
        dir,
        files,
        format!("Add the setting {var}={value} to /app/{dir}/.env."),
        &format!("add {var}={value} to the .env file"),
        (format!("echo '{var}={value}' >> /app/{dir}/.env"), String::new()),
        (format!("grep '{var}' /app/{dir}/.env"), format!("{var}={value}")),
    )
}
fn symlink(c: &mut Ctx) -> Task {
    let dir = c.pick(&["releases", "builds", "versions"]);
    let version = format!("v{}.{}", c.num(1, 9), c.num(0, 20));
    let files = vec![(version.clone(), 4096), (format!("v0.{}", c.num(1, 9)), 4096)];
    transforming(
        c,
        "symlink",
        "system_administration",
        dir,
        files,
        format!("Make /app/current a symbolic link to /app/{dir}/{version}."),
        &format!("point /app/current at {version}"),
        (format!("ln -sfn /app/{dir}/{version} /app/current"), String::new()),
        ("readlink /app/current".into(), format!("/app/{dir}/{version}")),
    )
}
fn pip_install(c: &mut Ctx) -> Task {
    let (pkg, ver) = c.pick(PACKAGES);
    let files = vec![("requirements.txt".to_string(), c.num(40, 300)), ("main.py".to_string(), c.num(400, 4000))];
    transforming(
        c,
        "pip_install",
        "dependency_management",
        "project",
        files,
        format!("Install version {ver} of the Python package {pkg} and check that it is installed."),
        &format!("install {pkg}=={ver}"),
        (format!("pip install {pkg}=={ver}"), format!("Successfully installed {pkg}-{ver}")),
        (format!("pip show {pkg} | grep Version"), format!("Version: {ver}")),
    )
}
fn compile_c(c: &mut Ctx) -> Task {
    let name = c.pick(&["hello", "calc", "parser", "server", "stats"]);
    let output = c.pick(&["Hello, world!", "ok", "42", "done", "ready"]);
    let files = vec![(format!("{name}.c"), c.num(200, 3000)), ("Makefile".to_string(), c.num(100, 600))];
    transforming(
        c,
        "compile_c",
        "software_engineering",
        "src",
        files,
        format!("Compile /app/src/{name}.c with gcc into the executable /app/{name} and run it."),
        &format!("build {name}.c into /app/{name}"),
        (format!("gcc -O2 -o /app/{name} /app/src/{name}.c"), String::new()),
        (format!("/app/{name}"), output.to_string()),
    )
}
fn run_tests(c: &mut Ctx) -> Task {
    let module = c.pick(&["parser", "utils", "models", "api", "cli"]);
    let n = c.num(3, 60);
    let millis = c.num(10, 99);
    let files = vec![(format!("test_{module}.py"), c.num(300, 6000)), (format!("{module}.py"), c.num(300, 9000))];
    transforming(
        c,
        "run_tests",
        "software_engineering",
        "tests",
        files,
        format!("Run the tests in /app/tests/test_{module}.py with pytest and report how many passed."),
        &format!("run test_{module}.py"),
        (format!("python3 -m pytest -q /app/tests/test_{module}.py"), format!("{n} passed in 0.{millis:02}s")),
        (
            format!("python3 -m pytest -q /app/tests/test_{module}.py | tail -n 1 > /app/test_summary.txt"),
            String::new(),
        ),
    )
}
fn git_commit(c: &mut Ctx) -> Task {
    let dir = c.pick(&["site", "docs", "tool", "service"]);
    let msg = format!("{} {}", c.pick(&["Add", "Update", "Fix"]), c.pick(&["readme", "config", "parser", "tests"]));
    let hash = c.num(0x100000, 0xfffffff);
    let files = vec![("README.md".to_string(), c.num(100, 3000)), ("main.py".to_string(), c.num(300, 5000))];
    transforming(
        c,
        "git_commit",
        "software_engineering",
        dir,
        files,
        format!("Initialise a git repository in /app/{dir} and commit all files with the message '{msg}'."),
        &format!("commit /app/{dir} as '{msg}'"),
        (format!("cd /app/{dir} && git init -q && git add -A && git commit -q -m '{msg}'"), String::new()),
        ("git log --oneline".into(), format!("{hash:07x} {msg}")),
    )
}
fn disk_usage(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let size = format!("{}{}", c.num(1, 900), c.pick(&["K", "M", "G"]));
    let keep = format!("{}.bin", c.pick(STEMS));
    let files = others(c, &keep, "bin");
    transforming(
        c,
        "disk_usage",
        "system_administration",
        dir,
        files,
        format!("Write the total disk usage of /app/{dir} in human-readable form (du -sh) to /app/usage.txt."),
        &format!("measure the size of /app/{dir}"),
        (format!("du -sh /app/{dir} > /app/usage.txt"), String::new()),
        ("cat /app/usage.txt".into(), format!("{size}\t/app/{dir}")),
    )
}
fn find_recent(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let days = c.num(1, 14);
    let keep = format!("{}.log", c.pick(STEMS));
    let files = others(c, &keep, "log");
    let recent: Vec<String> = files.iter().take(2).map(|(f, _)| format!("/app/{dir}/{f}")).collect();
    transforming(
        c,
        "find_recent",
        "file_operations",
        dir,
        files,
        format!("List the files in /app/{dir} modified in the last {days} days into /app/recent.txt."),
        &format!("find files changed in the last {days} days"),
        (format!("find /app/{dir} -type f -mtime -{days} > /app/recent.txt"), String::new()),
        ("cat /app/recent.txt".into(), recent.join("\n")),
    )
}
fn csv_filter(c: &mut Ctx) -> Task {
    let dir = c.pick(DIRS);
    let file = format!("{}.csv", c.pick(STEMS));
    let value = c.pick(&["active", "pending", "closed", "EU", "US", "premium"]);
    let col = c.num(2, 5);
    let out = format!("/app/{dir}/{value}.csv");
    let n = c.num(2, 400);
    let files = others(c, &file, "csv");
    transforming(
        c,
        "csv_filter",
        "data_processing",
        dir,
        files,
        format!("Write the rows of /app/{dir}/{file} whose column {col} equals '{value}' to {out}."),
        &format!("filter {file} on column {col} = {value}"),
        (format!("awk -F, '${col} == \"{value}\"' /app/{dir}/{file} > {out}"), String::new()),
        (format!("wc -l < {out}"), n.to_string()),
    )
}
fn service_port(c: &mut Ctx) -> Task {
    let service = c.pick(&["nginx", "redis", "postgres", "api", "worker"]);
    let port = c.num(1024, 9999);
    let path = format!("/app/config/{service}.conf");
    let files = others(c, &format!("{service}.conf"), "conf");
    let cmd = format!("grep -i '^port' {path}");
    let steps = vec![
        explore(c, "config", &files, &format!("I need the port {service} is configured to use")),
        Step::new(
            format!("{service}.conf is in /app/config. The port line starts with 'port'."),
            format!("{service}.conf exists. Its port is not known yet."),
            format!("Read the port setting with `{cmd}`."),
            &[(&cmd, &format!("port {port}"))],
            false,
        ),
        Step::new(
            format!("The configured port is {port}. I write {port} to /app/port.txt."),
            format!("{service} uses port {port}. The answer file is still missing."),
            format!("Write {port} to /app/port.txt and show it."),
            &[(&format!("echo {port} > /app/port.txt"), ""), ("cat /app/port.txt", &port.to_string())],
            true,
        ),
    ];
    Task {
        family: "service_port",
        group: "system_administration",
        description: format!("Find the port configured in {path} and write just the number to /app/port.txt."),
        steps,
    }
}

const FAMILIES: &[(&str, Family)] = &[
    ("count_lines", count_lines),
    ("count_words", count_words),
    ("count_matches", count_matches),
    ("count_csv_rows", count_csv_rows),
    ("column_sum", column_sum),
    ("unique_values", unique_values),
    ("count_files", count_files),
    ("largest_file", largest_file),
    ("replace_text", replace_text),
    ("sort_unique", sort_unique),
    ("head_lines", head_lines),
    ("tail_errors", tail_errors),
    ("make_archive", make_archive),
    ("move_by_ext", move_by_ext),
    ("set_permissions", set_permissions),
    ("checksum", checksum),
    ("top_ip", top_ip),
    ("json_field", json_field),
    ("env_var", env_var),
    ("symlink", symlink),
    ("pip_install", pip_install),
    ("compile_c", compile_c),
    ("run_tests", run_tests),
    ("git_commit", git_commit),
    ("disk_usage", disk_usage),
    ("find_recent", find_recent),
    ("csv_filter", csv_filter),
    ("service_port", service_port),
];

/// Task `index` cycles through the families, so every family appears in train and held-out sets alike.
pub fn task(rng: &mut ChaCha8Rng, index: usize) -> Task {
    let (_, family) = FAMILIES[index % FAMILIES.len()];
    family(&mut Ctx { rng })
}

/// Names of the task families, in the order tasks cycle through them.
pub fn family_names() -> Vec<&'static str> {
    FAMILIES.iter().map(|(name, _)| *name).collect()
}
