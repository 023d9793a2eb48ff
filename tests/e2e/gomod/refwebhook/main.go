// Command refwebhook is the benchmark's reference peer: a minimal Go mutating webhook that answers
// every AdmissionReview with one fixed JSON Patch (the one gpufence computes for the benchmark's
// pod). It shows what the API server's pod-creation rate is with an admission webhook that costs
// almost nothing, so the benchmark can tell gpufence's own cost from the cost of any webhook call.
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
)

type review struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Request    *request  `json:"request,omitempty"`
	Response   *response `json:"response,omitempty"`
}

type request struct {
	UID    string `json:"uid"`
	Object struct {
		Spec struct {
			InitContainers []struct {
				Name string `json:"name"`
			} `json:"initContainers"`
		} `json:"spec"`
	} `json:"object"`
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
	encoded := base64.StdEncoding.EncodeToString(patch)
	http.HandleFunc("/mutate", func(w http.ResponseWriter, r *http.Request) {
		var in review
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Request == nil {
			http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
			return
		}
		resp := &response{UID: in.Request.UID, Allowed: true}
		if !injected(in.Request) {
			resp.PatchType, resp.Patch = "JSONPatch", encoded
		}
		out := review{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview", Response: resp}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	})
	http.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) })
	log.Printf("serving on %s", *addr)
	log.Fatal(http.ListenAndServeTLS(*addr, *cert, *key, nil))
}
