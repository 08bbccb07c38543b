// llama.cpp's side of dev/bench/bench_llamacpp.sh, through node-llama-cpp's prebuilt CPU
// binaries (installed by that script under build/llamacpp): a GGUF file from build/export_gguf,
// one sequence, the CPU backend, `threads` threads, no mmap (the weights read into memory).
//
//   node llamacpp_decode.mjs DIR MODEL.gguf greedy THREADS PROMPT_IDS N
//       prints the N greedy tokens after PROMPT_IDS (comma-separated ids, no BOS added), and
//       the smallest gap between the top two logits over those steps
//   node llamacpp_decode.mjs DIR MODEL.gguf time THREADS PROMPT_LEN N
//       a prompt of PROMPT_LEN tokens (ids i * 977 mod V, as build/bench_decode's), then N
//       single-token evaluations, greedy; one warm-up round, then one timed round; prints the
//       wall ms per decoded token (the prompt excluded), llama.cpp's own eval timer per token,
//       the threads the context used, the process's CPU time over the wall time of the timed
//       decode (about THREADS when the threads really ran), and the ggml CPU variant loaded
//   node llamacpp_decode.mjs DIR MODEL.gguf tokenize TEXT_FILE
//       prints llama.cpp's token ids of the file's text (its BPE on the file's vocabulary and
//       merges; special tokens not parsed)
// DIR is the folder holding node_modules/node-llama-cpp.
import {createRequire} from "node:module";
import {readFileSync} from "node:fs";
import {resolve} from "node:path";
import {pathToFileURL} from "node:url";

const [dir, modelPath, mode, ...args] = process.argv.slice(2);
if (args.length !== (mode === "tokenize" ? 1 : 3)) {
    console.error("usage: node llamacpp_decode.mjs DIR MODEL.gguf greedy|time THREADS PROMPT_IDS|PROMPT_LEN N, " +
                  "or DIR MODEL.gguf tokenize TEXT_FILE");
    process.exit(1);
}
const [threadsArg, promptArg, nArg] = args;
const threads = mode === "tokenize" ? 1 : Number(threadsArg), n = Number(nArg);
const entry = createRequire(resolve(dir, "package.json")).resolve("node-llama-cpp");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);

const logs = [];
const llama = await getLlama({
    gpu: false, build: "never", maxThreads: threads, logLevel: LlamaLogLevel.info,
    logger: (level, message) => logs.push(message)
});
const model = await llama.loadModel({modelPath, useMmap: false});
if (mode === "tokenize") {
    console.log(model.tokenize(readFileSync(args[0], "utf8"), false).join(" "));
    process.exit(0);
}
const prompt = mode === "greedy" ? promptArg.split(",").map(Number)
                                 : Array.from({length: Number(promptArg)}, (_, i) => (i * 977) % 50257);
const context = await model.createContext({
    contextSize: Math.max(64, prompt.length + n + 1), threads, sequences: 1, performanceTracking: true
});
const sequence = context.getSequence();

if (mode === "greedy") {
    // one token at a time, each with its logits: the greedy token and its margin over the second
    const out = [];
    let minGap = Infinity, next = prompt;
    for (let i = 0; i < n; i++) {
        const input = next.map((t, k) => k === next.length - 1 ? [t, {generateNext: {token: true, logits: true}}] : t);
        const result = await sequence.controlledEvaluate(input);
        const last = result[input.length - 1].next;
        const sorted = [...last.logits.values()].sort((a, b) => b - a);
        minGap = Math.min(minGap, sorted[0] - sorted[1]);
        out.push(last.token);
        next = [last.token];
    }
    console.log(out.join(","));
    console.log(`smallest top-1 - top-2 logit gap ${minGap.toPrecision(3)}`);
} else {
    const round = async () => {
        await sequence.clearHistory();
        const produced = [];
        let t0 = 0, cpu0 = null;
        for await (const token of sequence.evaluate(prompt, {temperature: 0})) {
            if (produced.length === 0) { t0 = performance.now(); cpu0 = process.cpuUsage(); }   // the prompt is done
            produced.push(token);
            if (produced.length > n) break;
        }
        const wall = performance.now() - t0, cpu = process.cpuUsage(cpu0);
        return {msPerToken: wall / n, cpuPerWall: (cpu.user + cpu.system) / 1e3 / wall};
    };
    await round();                      // warm-up
    await context.printTimings();       // (and resets llama.cpp's counters)
    logs.length = 0;
    const timed = await round();
    await context.printTimings();
    // llama_perf_context_print: "eval time = X ms / N runs ( Y ms per token, ...)": the decode steps only
    const evalLine = logs.find(l => /\beval time/.test(l) && !/prompt eval/.test(l)) ?? "";
    const evalMs = Number((evalLine.match(/\(\s*([\d.]+) ms per token/) ?? [])[1]);
    const variants = [...new Set(readFileSync("/proc/self/maps", "utf8").split("\n")
        .map(l => (l.match(/libggml-cpu-([\w-]+)\.so/) ?? [])[1]).filter(Boolean))];
    console.log(`ms_per_token ${timed.msPerToken.toFixed(3)} eval_ms_per_token ${evalMs.toFixed(3)} ` +
                `threads ${context.currentThreads} cpu_per_wall ${timed.cpuPerWall.toFixed(2)} ` +
                `variant ${variants.join("+") || "none"}`);
}
await context.dispose();
await model.dispose();
