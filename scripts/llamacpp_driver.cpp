// Runs one pagedinfer-style workload through llama.h: a warm-up, then every prompt decoded once, its KV
// copied to its n completions, then all sequences decoded together (greedy) until each has max_new tokens.
// Usage: llamacpp_driver MODEL.gguf WORKLOAD.txt THREADS [KV_TYPE]
//   WORKLOAD.txt: "n max_new num_prompts warm_new", the warm-up prompt "len tok1 tok2 ...", then one line
//   per prompt in the same form. KV_TYPE: f16 (llama.cpp's default), f32 or bf16: the K and V cache type.
// Prints one JSON line: wall_s (prefill + decode; model load and warm-up excluded), prefill_s,
// peak_rss_mb (the process's peak resident set, model and KV cache included), kv_type, system_info
// (llama.cpp's line of the instruction sets it was built with), and every sequence's generated token ids
// (to compare with pagedinfer's).
//
// The warm-up (the same one pagedinfer's timed runs follow: a prompt of other tokens, warm_new tokens
// greedy) touches every weight and sizes the compute buffers before the clock starts; the KV cache is
// then cleared, so the timed run shares nothing with it.
//
// The context takes llama.cpp's defaults except for sizes and KV_TYPE: one KV stream per sequence
// (kv_unified false: a unified cache makes every token attend over all sequences' cells, masked) and
// flash attention AUTO (on for the CPU, skipping masked cells). An earlier version of this driver set
// kv_unified true and flash attention off, which made llama.cpp 1.2-4x slower on the batched workloads.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <cstring>
#include <string>
#include <vector>

#include "llama.h"

static int argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

// This process's peak resident set in kB: VmHWM, which exec resets (ru_maxrss keeps the high-water
// mark of the parent's pages the child was forked with: a 1.5 GB Python parent made every run 1.5 GB).
static long peak_rss_kb() {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line))
        if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_maxrss;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf WORKLOAD.txt THREADS [f16|f32|bf16]\n", argv[0]);
        return 2;
    }
    const char *kv_name = argc == 5 ? argv[4] : "f16";
    ggml_type kv_type;
    if (!strcmp(kv_name, "f16")) kv_type = GGML_TYPE_F16;
    else if (!strcmp(kv_name, "f32")) kv_type = GGML_TYPE_F32;
    else if (!strcmp(kv_name, "bf16")) kv_type = GGML_TYPE_BF16;
    else {
        fprintf(stderr, "unknown KV type '%s': choose f16, f32 or bf16\n", kv_name);
        return 2;
    }
    std::ifstream in(argv[2]);
    int n, max_new, num_prompts, warm_new;
    in >> n >> max_new >> num_prompts >> warm_new;
    auto read_prompt = [&in]() {
        int len;
        in >> len;
        std::vector<llama_token> p(len);
        for (auto &t : p) in >> t;
        return p;
    };
    const std::vector<llama_token> warm = read_prompt();
    std::vector<std::vector<llama_token>> prompts(num_prompts);
    size_t longest = warm.size() + warm_new;
    for (auto &p : prompts) {
        p = read_prompt();
        longest = std::max(longest, p.size() + max_new);
    }
    const int threads = atoi(argv[3]), seqs = num_prompts * n;
    llama_backend_init();
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    llama_context_params cp = llama_context_default_params();
    const size_t per_seq = (longest + 255) / 256 * 256;  // each stream's cells (llama.cpp pads to 256)
    cp.n_ctx = per_seq * seqs;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_seq_max = seqs;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.type_k = cp.type_v = kv_type;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_memory_t mem = llama_get_memory(ctx);
    llama_batch batch = llama_batch_init(2048 > seqs ? 2048 : seqs, 0, 1);
    std::vector<std::vector<llama_token>> out(seqs);
    // warm-up: the warm-up prompt in sequence 0, then warm_new - 1 greedy decode steps; the cache cleared
    batch.n_tokens = warm.size();
    for (size_t i = 0; i < warm.size(); i++) {
        batch.token[i] = warm[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i + 1 == warm.size();
    }
    if (llama_decode(ctx, batch)) return 1;
    for (int step = 1; step < warm_new; step++) {
        batch.token[0] = argmax(llama_get_logits_ith(ctx, -1), vocab);
        batch.pos[0] = warm.size() + step - 1;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
        if (llama_decode(ctx, batch)) return 1;
    }
    llama_memory_clear(mem, true);
    auto t0 = std::chrono::steady_clock::now();
    // prefill: prompts packed into batches of up to n_batch tokens, logits at each prompt's last token
    for (int p = 0; p < num_prompts;) {
        batch.n_tokens = 0;
        std::vector<int> in_batch;
        while (p < num_prompts && batch.n_tokens + (int)prompts[p].size() <= (int)cp.n_batch) {
            for (size_t i = 0; i < prompts[p].size(); i++) {
                int k = batch.n_tokens++;
                batch.token[k] = prompts[p][i];
                batch.pos[k] = i;
                batch.n_seq_id[k] = 1;
                batch.seq_id[k][0] = p * n;
                batch.logits[k] = i + 1 == prompts[p].size();
            }
            in_batch.push_back(p++);
        }
        if (llama_decode(ctx, batch)) return 1;
        int row = 0;
        for (int q : in_batch) {
            row += prompts[q].size();
            int tok = argmax(llama_get_logits_ith(ctx, row - 1), vocab);
            for (int j = 0; j < n; j++) {
                if (j) llama_memory_seq_cp(mem, q * n, q * n + j, -1, -1);
                out[q * n + j].push_back(tok);
            }
        }
    }
    auto t1 = std::chrono::steady_clock::now();
    for (int step = 1; step < max_new; step++) {  // every sequence: its last token in, one token out
        batch.n_tokens = seqs;
        for (int s = 0; s < seqs; s++) {
            batch.token[s] = out[s].back();
            batch.pos[s] = prompts[s / n].size() + out[s].size() - 1;
            batch.n_seq_id[s] = 1;
            batch.seq_id[s][0] = s;
            batch.logits[s] = 1;
        }
        if (llama_decode(ctx, batch)) return 1;
        for (int s = 0; s < seqs; s++) out[s].push_back(argmax(llama_get_logits_ith(ctx, s), vocab));
    }
    auto t2 = std::chrono::steady_clock::now();
    std::string info = llama_print_system_info();  // e.g. "CPU : SSE3 = 1 | AVX2 = 1 | ... |"
    for (char &c : info)
        if (c == '"' || c == '\\' || (unsigned char)c < 0x20) c = ' ';  // a JSON string as it is
    printf("{\"wall_s\": %.4f, \"prefill_s\": %.4f, \"peak_rss_mb\": %.1f, \"kv_type\": \"%s\", "
           "\"system_info\": \"%s\", \"outputs\": [",
           std::chrono::duration<double>(t2 - t0).count(), std::chrono::duration<double>(t1 - t0).count(),
           peak_rss_kb() / 1024.0, kv_name, info.c_str());
    for (int s = 0; s < seqs; s++) {
        printf("%s[", s ? ", " : "");
        for (size_t i = 0; i < out[s].size(); i++) printf("%s%d", i ? ", " : "", out[s][i]);
        printf("]");
    }
    printf("]}\n");
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
