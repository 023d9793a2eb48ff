// Command refwebhook is the benchmark's reference peer: a minimal Go webhook registered the way
// gpufence is. On /mutate it answers every AdmissionReview with one fixed JSON Patch (the one
// gpufence computes for the benchmark's pod), plus the one per-pod part of it: the sidecar's mount
// of the ServiceAccount token volume, whose name the API server randomises per pod. On /validate
// (gpufence's verify.gpufence.io re-reviews the final pod there) it decodes the same envelope and
// answers allowed. It shows what the API server's pod-creation rate is with admission webhooks that
// cost almost nothing, so the benchmarks can tell gpufence's own cost from the cost of any webhook call.
//
//	refwebhook -addr 127.0.0.1:8443 -cert tls.crt -key tls.key -patch patch.json
package main

import (
	"encoding/base64"
	"encoding/json"
	"flag"
	"log"
	"net/http"
	"os"
	"strconv"
)

type review struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Request    *request  `json:"request,omitempty"`
	Response   *response `json:"response,omitempty"`
}

type mount struct {
	Name      string `json:"name"`
	ReadOnly  bool   `json:"readOnly"`
	MountPath string `json:"mountPath"`
}

type request struct {
	UID    string `json:"uid"`
	Object struct {
		Spec struct {
			InitContainers []struct {
				Name string `json:"name"`
			} `json:"initContainers"`
			Containers []struct {
				VolumeMounts []mount `json:"volumeMounts"`
			} `json:"containers"`
		} `json:"spec"`
	} `json:"object"`
}

const tokenPath = "/var/run/secrets/kubernetes.io/serviceaccount"

// withToken returns the patch with the pod's token mount appended to the sidecar's mounts (the
// "add /spec/initContainers" operation), as gpufence does.
func withToken(ops []map[string]any, r *request) []map[string]any {
	var token *mount
	for _, c := range r.Object.Spec.Containers {
		for i := range c.VolumeMounts {
			if c.VolumeMounts[i].MountPath == tokenPath {
				token = &c.VolumeMounts[i]
			}
		}
	}
	if token == nil {
		return ops
	}
	out := make([]map[string]any, len(ops))
	copy(out, ops)
	for i, op := range ops {
		inits, ok := op["value"].([]any)
		if op["path"] != "/spec/initContainers" || !ok || len(inits) == 0 {
			continue
		}
		sidecar := map[string]any{}
		for k, v := range inits[0].(map[string]any) {
			sidecar[k] = v
		}
		mounts, _ := sidecar["volumeMounts"].([]any)
		sidecar["volumeMounts"] = append(append([]any{}, mounts...), *token)
		value := append([]any{sidecar}, inits[1:]...)
		out[i] = map[string]any{"op": op["op"], "path": op["path"], "value": value}
	}
	return out
}

// injected reports whether the pod already carries the enforcer: like gpufence, the peer must
// answer a reinvocation with no patch, or the API server would apply the patch twice.
func injected(r *request) bool {
	for _, c := range r.Object.Spec.InitContainers {
		if c.Name == "gpufence-enforcer" {
			return true
		}
	}
	return false
}

type response struct {
	UID       string `json:"uid"`
	Allowed   bool   `json:"allowed"`
	PatchType string `json:"patchType,omitempty"`
	Patch     string `json:"patch,omitempty"`
}

// decode reads the AdmissionReview of a request, or answers 400 and returns false.
func decode(w http.ResponseWriter, r *http.Request) (review, bool) {
	var in review
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Request == nil {
		http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
		return in, false
	}
	return in, true
}

// answer writes the AdmissionReview with its Content-Length, as gpufence's server does (not chunked).
func answer(w http.ResponseWriter, resp *response) {
	body, err := json.Marshal(review{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview", Response: resp})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}

func main() {
	addr := flag.String("addr", "127.0.0.1:8443", "listen address")
	cert := flag.String("cert", "", "serving certificate (PEM)")
	key := flag.String("key", "", "private key (PEM)")
	patchFile := flag.String("patch", "", "JSON Patch to return")
	flag.Parse()
	patch, err := os.ReadFile(*patchFile)
	if err != nil {
		log.Fatal(err)
	}
	var ops []map[string]any
	if err := json.Unmarshal(patch, &ops); err != nil {
		log.Fatal(err)
	}
	http.HandleFunc("/mutate", func(w http.ResponseWriter, r *http.Request) {
		in, ok := decode(w, r)
		if !ok {
			return
		}
		resp := &response{UID: in.Request.UID, Allowed: true}
		if !injected(in.Request) {
			body, err := json.Marshal(withToken(ops, in.Request))
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			resp.PatchType, resp.Patch = "JSONPatch", base64.StdEncoding.EncodeToString(body)
		}
		answer(w, resp)
	})
	http.HandleFunc("/validate", func(w http.ResponseWriter, r *http.Request) {
		if in, ok := decode(w, r); ok {
			answer(w, &response{UID: in.Request.UID, Allowed: true})
		}
	})
	http.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) })
	log.Printf("serving on %s", *addr)
	log.Fatal(http.ListenAndServeTLS(*addr, *cert, *key, nil))
}
