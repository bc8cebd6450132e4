//! Synthetic ToolBench-style tool-use conversations in the OpenBMB form (`{id, conversations: [{from, value}]}`):
//! a system prompt listing functions, a user request, Thought/Action/Action Input calls, function results,
//! and a Finish call whose answer is read off those results.

use rand::Rng;
use rand::seq::IndexedRandom;
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

struct Tool {
    name: &'static str,
    description: &'static str,
    params: &'static [&'static str],
}

const TOOLS: &[Tool] = &[
    Tool { name: "get_weather", description: "Current weather for a city.", params: &["city"] },
    Tool {
        name: "convert_currency",
        description: "Convert an amount between currencies.",
        params: &["amount", "from", "to"],
    },
    Tool { name: "stock_quote", description: "Latest price of a stock ticker.", params: &["symbol"] },
    Tool { name: "city_timezone", description: "Time zone and local time of a city.", params: &["city"] },
    Tool { name: "translate_text", description: "Translate text into a target language.", params: &["text", "target"] },
    Tool { name: "search_books", description: "Books by an author.", params: &["author"] },
];

const CITIES: &[&str] = &["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Austin", "Pune", "Porto", "Seoul", "Quito"];
const CURRENCIES: &[&str] = &["USD", "EUR", "JPY", "GBP", "INR", "BRL"];
const TICKERS: &[&str] = &["ACME", "GLOBX", "INITECH", "UMBR", "HOOLI", "STARK"];
const AUTHORS: &[&str] = &["Ursula K. Le Guin", "Chinua Achebe", "Haruki Murakami", "Toni Morrison", "Italo Calvino"];
const PHRASES: &[(&str, &str, &str)] = &[
    ("good morning", "French", "bonjour"),
    ("thank you", "Spanish", "gracias"),
    ("see you soon", "German", "bis bald"),
];

fn system_prompt(tools: &[&Tool]) -> String {
    let specs: Vec<Value> = tools
        .iter()
        .map(|t| {
            let props: serde_json::Map<String, Value> = t.params.iter().map(|p| (p.to_string(), json!({"type": "string"}))).collect();
            json!({"name": t.name, "description": t.description, "parameters": {"type": "object", "properties": props, "required": t.params}})
        })
        .chain([json!({"name": "Finish", "description": "Give the final answer.", "parameters": {"type": "object", "properties": {"return_type": {"type": "string"}, "final_answer": {"type": "string"}}, "required": ["return_type"]}})])
        .collect();
    format!(
        "You can call functions to answer the user's request. Each turn, reply as\nThought: your reasoning\nAction: the function name\nAction Input: the arguments as JSON\nWhen you know the answer, call Finish with {{\"return_type\": \"give_answer\", \"final_answer\": \"...\"}}.\nFunctions:\n{}",
        serde_json::to_string(&specs).unwrap_or_default()
    )
}

fn call(thought: &str, name: &str, args: &Value) -> String {
    format!("Thought: {thought}\nAction: {name}\nAction Input: {}", serde_json::to_string(args).unwrap_or_default())
}

fn result(response: Value) -> String {
    serde_json::to_string(&json!({"error": "", "response": response})).unwrap_or_default()
}

/// One request: (tool, user text, arguments, function response, final answer).
fn request(rng: &mut ChaCha8Rng, tool: &Tool) -> (String, Value, Value, String) {
    let pick = |rng: &mut ChaCha8Rng, items: &[&'static str]| *items.choose(rng).expect("non-empty");
    match tool.name {
        "get_weather" => {
            let city = pick(rng, CITIES);
            let t = rng.random_range(-5..38);
            let sky = pick(rng, &["sunny", "cloudy", "raining", "windy"]);
            (
                format!("What's the weather like in {city} right now?"),
                json!({"city": city}),
                json!({"temperature_c": t, "conditions": sky}),
                format!("It is {t}°C and {sky} in {city}."),
            )
        }
        "convert_currency" => {
            let (from, to) = (pick(rng, CURRENCIES), pick(rng, CURRENCIES));
            let amount = rng.random_range(5..5000);
            let value = (amount as f64 * rng.random_range(0.01..150.0) * 100.0).round() / 100.0;
            (
                format!("How much is {amount} {from} in {to}?"),
                json!({"amount": amount.to_string(), "from": from, "to": to}),
                json!({"result": value}),
                format!("{amount} {from} is {value} {to}."),
            )
        }
        "stock_quote" => {
            let symbol = pick(rng, TICKERS);
            let price = (rng.random_range(1.0..900.0) * 100.0f64).round() / 100.0;
            (
                format!("What is {symbol} trading at?"),
                json!({"symbol": symbol}),
                json!({"symbol": symbol, "price": price}),
                format!("{symbol} is trading at {price}."),
            )
        }
        "city_timezone" => {
            let city = pick(rng, CITIES);
            let (h, m) = (rng.random_range(0..24), rng.random_range(0..60));
            let tz = format!("UTC{:+}", rng.random_range(-10..12));
            (
                format!("What time is it in {city}?"),
                json!({"city": city}),
                json!({"timezone": tz, "local_time": format!("{h:02}:{m:02}")}),
                format!("It is {h:02}:{m:02} in {city} ({tz})."),
            )
        }
        "translate_text" => {
            let (text, lang, out) = *PHRASES.choose(rng).expect("non-empty");
            (
                format!("How do I say '{text}' in {lang}?"),
                json!({"text": text, "target": lang}),
                json!({"translation": out}),
                format!("'{text}' in {lang} is '{out}'."),
            )
        }
        _ => {
            let author = pick(rng, AUTHORS);
            let n = rng.random_range(1..4);
            let titles: Vec<String> = (1..=n).map(|i| format!("Book {i} by {author}")).collect();
            (
                format!("Find me some books by {author}."),
                json!({"author": author}),
                json!({"books": titles}),
                format!("Books by {author}: {}.", titles.join(", ")),
            )
        }
    }
}

/// One conversation with one or two tool calls, in the OpenBMB ToolBench layout.
pub fn conversation(rng: &mut ChaCha8Rng, index: usize) -> Value {
    let first = &TOOLS[index % TOOLS.len()];
    let second = &TOOLS[(index / TOOLS.len() + index + 1) % TOOLS.len()];
    let two = rng.random_bool(0.4) && second.name != first.name;
    let offered: Vec<&Tool> = if two { vec![first, second] } else { vec![first] };
    let mut turns = vec![json!({"from": "system", "value": system_prompt(&offered)})];
    let mut asks = Vec::new();
    let mut answers = Vec::new();
    let mut calls = Vec::new();
    for tool in &offered {
        let (ask, args, response, answer) = request(rng, tool);
        asks.push(ask);
        answers.push(answer);
        calls.push((tool.name, args, response));
    }
    turns.push(json!({"from": "user", "value": asks.join(" ")}));
    for (name, args, response) in calls {
        turns
            .push(json!({"from": "assistant", "value": call(&format!("I should call {name} for this."), name, &args)}));
        turns.push(json!({"from": "function", "value": result(response)}));
    }
    let final_answer = answers.join(" ");
    turns.push(json!({"from": "assistant", "value": call("I have everything I need.", "Finish", &json!({"return_type": "give_answer", "final_answer": final_answer}))}));
    json!({"id": format!("Step {index}: {}", asks.join(" ")), "conversations": turns})
}
