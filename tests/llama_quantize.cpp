// What `llama-quantize --allow-requantize IN OUT TYPE` does, as a program of its own: llama.cpp's
// quantizer (llama_model_quantize in libllama, the function that tool calls, with the same
// parameters) without the tool's common library, so scripts/kquant-golden builds libllama and
// GGML's base library alone (about 1.5 min on 2 cores, where the tool took 9). Its files are byte
// for byte the tool's.
//   llama_quantize IN.gguf OUT.gguf Q4_K_M|Q5_K_M|Q6_K|Q4_0
#include <cstdio>
#include <cstring>

#include "llama.h"

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s IN.gguf OUT.gguf Q4_K_M|Q5_K_M|Q6_K|Q4_0\n", argv[0]);
        return 2;
    }
    const struct {
        const char * name;
        llama_ftype ftype;
    } types[] = {
        {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M},
        {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M},
        {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K},
        {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},
    };
    llama_model_quantize_params params = llama_model_quantize_default_params();
    bool known = false;
    for (const auto & t : types) {
        if (std::strcmp(argv[3], t.name) == 0) {
            params.ftype = t.ftype;
            known = true;
        }
    }
    if (!known) {
        std::fprintf(stderr, "%s: unknown type %s (Q4_K_M, Q5_K_M, Q6_K or Q4_0)\n", argv[0], argv[3]);
        return 2;
    }
    // The default model is Q4_1: requantizing decodes it to f32 and quantizes that.
    params.allow_requantize = true;
    llama_backend_init();
    const uint32_t rc = llama_model_quantize(argv[1], argv[2], &params);
    llama_backend_free();
    if (rc != 0) {
        std::fprintf(stderr, "%s: quantizing %s to %s failed\n", argv[0], argv[1], argv[3]);
        return 1;
    }
    return 0;
}
