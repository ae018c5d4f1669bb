// llama.cpp's logits for given token ids, for the agreement check against glmflash
// (e2e/peers/agree.py). llama.cpp's own tools take text, and our random tokenizer's text does not
// round-trip through llama.cpp's glm4 pre-tokenizer, so this feeds ids through the library API.
//
//   llama_logits MODEL.gguf TOKENS(comma-separated) N_GREEDY OUT.json [N_GPU_LAYERS] [THREADS]
//
// OUT.json: {"prompt": [ids], "prefill_logits": [[V floats] per prompt position] (one batch, every
// position's logits), "greedy": [N_GREEDY ids] (argmax, ties to the lowest id, each step decoded
// with the cache), "greedy_logits": [[V floats] per greedy step] (the logits that chose it)}.
// Build (CMake tree of llama.cpp in LC, built with BUILD_SHARED_LIBS=ON):
//   g++ -O2 -std=c++17 e2e/peers/llama_logits.cpp -I$LC/include -I$LC/ggml/include \
//       -L$LC/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LC/build/bin -o llama_logits
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static void write_row(FILE * f, const float * row, int n) {
    fputc('[', f);
    for (int i = 0; i < n; ++i) {
        fprintf(f, i ? ",%.9g" : "%.9g", row[i]);
    }
    fputc(']', f);
}

static int argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
        if (row[i] > row[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS N_GREEDY OUT.json [N_GPU_LAYERS] [THREADS]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> prompt;
    for (std::string s = argv[2]; !s.empty();) {
        const size_t c = s.find(',');
        prompt.push_back(std::atoi(s.substr(0, c).c_str()));
        s = c == std::string::npos ? "" : s.substr(c + 1);
    }
    const int n_greedy = std::atoi(argv[3]);

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = argc > 5 ? std::atoi(argv[5]) : 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = prompt.size() + n_greedy + 16;
    cp.n_batch = cp.n_ubatch = prompt.size();
    if (argc > 6) {
        cp.n_threads = cp.n_threads_batch = std::atoi(argv[6]);
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));

    FILE * f = fopen(argv[4], "w");
    fprintf(f, "{\"prompt\":[");
    for (size_t i = 0; i < prompt.size(); ++i) {
        fprintf(f, i ? ",%d" : "%d", prompt[i]);
    }
    fprintf(f, "],\"prefill_logits\":[");

    llama_batch batch = llama_batch_init(prompt.size(), 0, 1);
    for (size_t i = 0; i < prompt.size(); ++i) {
        batch.token[i] = prompt[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = prompt.size();
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "prefill decode failed\n");
        return 1;
    }
    for (size_t i = 0; i < prompt.size(); ++i) {
        if (i) {
            fputc(',', f);
        }
        write_row(f, llama_get_logits_ith(ctx, i), V);
    }
    std::vector<int> greedy;
    std::vector<std::vector<float>> steps;
    const float * last = llama_get_logits_ith(ctx, prompt.size() - 1);
    for (int s = 0; s < n_greedy; ++s) {
        steps.emplace_back(last, last + V);
        const int tok = argmax(last, V);
        greedy.push_back(tok);
        if (s + 1 == n_greedy) {
            break;
        }
        batch.token[0] = tok;
        batch.pos[0] = prompt.size() + s;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "decode step %d failed\n", s);
            return 1;
        }
        last = llama_get_logits_ith(ctx, 0);
    }
    fprintf(f, "],\"greedy\":[");
    for (size_t i = 0; i < greedy.size(); ++i) {
        fprintf(f, i ? ",%d" : "%d", greedy[i]);
    }
    fprintf(f, "],\"greedy_logits\":[");
    for (size_t i = 0; i < steps.size(); ++i) {
        if (i) {
            fputc(',', f);
        }
        write_row(f, steps[i].data(), V);
    }
    fprintf(f, "]}\n");
    fclose(f);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
